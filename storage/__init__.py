"""Where the farm keeps what it makes: content-addressed blobs, manifests, job results.

No torch and no ray in here: storage is plain bytes and tables.
"""
from storage.backend import Backend, StoreError
from storage.store import BlobRef, CorruptBlob, Store
from storage.uri import download_uri, store_from_uri

__all__ = ["Backend", "BlobRef", "CorruptBlob", "Store", "StoreError", "download_uri", "store_from_uri"]
