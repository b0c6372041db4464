"""Where the farm keeps what it makes: content-addressed blobs, manifests, job results.

No torch and no ray in here: storage is plain bytes and tables.
"""
from storage.backend import Backend, NoSuchStore, StoreError, StoreUnwritable, UnsafeStore
from storage.leases import Lease, LeaseInfo, Leases
from storage.store import BlobRef, CorruptBlob, Store, Transfer, UnknownKey
from storage.tiered import CacheConfig, TieredStore
from storage.uri import download_uri, store_from_uri

__all__ = ["Backend", "BlobRef", "CacheConfig", "CorruptBlob", "Lease", "LeaseInfo", "Leases", "NoSuchStore", "Store",
           "StoreError", "StoreUnwritable", "TieredStore", "Transfer", "UnknownKey", "UnsafeStore", "download_uri",
           "store_from_uri"]
