"""The only place that knows which store backends exist."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

from storage.store import Store
from storage.tiered import CacheConfig, LocalBlobCache, TieredStore


def default_store() -> str:
    """The store when none is named: FARM_STORE, else .farm/store in the working directory."""
    return os.environ.get("FARM_STORE", ".farm/store")


def store_from_uri(uri: str, cache: CacheConfig | None = None, create: bool = True) -> Store:
    """`/path`, `relative/path`, `file:///path` → local directory; `s3://bucket/prefix` → S3.

    With a cache config, a remote store gets a local disk tier for blobs (a local store
    needs none: its blobs are already on disk). Without `create`, a local directory must exist
    already (NoSuchStore): for callers that only read."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        from storage.local import LocalBackend

        return Store(LocalBackend(parsed.path if parsed.scheme else uri, create=create))
    if parsed.scheme == "s3":
        from storage.s3 import S3Backend

        backend = S3Backend(parsed.netloc, parsed.path)
        return TieredStore(backend, LocalBlobCache(cache)) if cache else Store(backend)
    raise ValueError(f"unknown store URI scheme {parsed.scheme!r} in {uri!r}: use a directory path, file://… or s3://bucket/prefix")


def download_uri(uri: str, dest: Path) -> None:
    """Copy a graph named by URI (s3://bucket/key or file://path) to a local file."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from storage.s3 import S3Backend

        if not S3Backend(parsed.netloc).download_file(parsed.path.lstrip("/"), dest):
            raise FileNotFoundError(f"{uri} does not exist")
    elif parsed.scheme == "file":
        shutil.copyfile(parsed.path, dest)
    else:
        raise ValueError(f"cannot read {uri!r}: use a local path, file://… or s3://bucket/key")
