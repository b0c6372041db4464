"""Opening the store a caller names (a URI, a Store, or None for the default): shared by the
client, warm starts and the service client, so none of them imports another for it."""
from __future__ import annotations

from storage import CacheConfig, Store, store_from_uri
from storage.uri import default_store


def open_store(store: str | Store | None, create: bool = True) -> Store:
    """A store given by URI (None: FARM_STORE, else .farm/store), with the local disk tier workers
    use. Without `create`, a local store's directory must exist (storage.NoSuchStore): for readers."""
    if isinstance(store, Store):
        return store
    return store_from_uri(store or default_store(), CacheConfig.from_env(), create=create)
