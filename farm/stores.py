"""Opening the store a caller names (a URI, a Store, or None for the default): shared by the
client, warm starts and the service client, so none of them imports another for it."""
from __future__ import annotations

from storage import CacheConfig, Store, store_from_uri
from storage.uri import default_store


def open_store(store: str | Store | None) -> Store:
    """A store given by URI (None: FARM_STORE, else .farm/store), with the local disk tier workers use."""
    return store if isinstance(store, Store) else store_from_uri(store or default_store(), CacheConfig.from_env())
