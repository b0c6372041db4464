"""The one plug-in point of storage: a flat object namespace with a conditional write.

Backends know nothing of the layout (blobs, manifests, jobs); `Store` does. Paths are
'/'-separated relative names such as ``units/<key>.json``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol


class StoreError(RuntimeError):
    """An I/O failure talking to a store, carrying its cause."""


class StoreUnwritable(StoreError):
    """The store refuses what is written to it (its disk full, read-only, not ours to write):
    trying again in a moment will not help."""


class NoSuchStore(StoreError):
    """A local store that a reader named is not there (no such directory): a mistyped path is
    said, not answered as a new, empty store."""


class UnsafeStore(StoreError):
    """The store works but cannot be published to safely (e.g. it ignores conditional writes);
    trying again will not help."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object as a listing sees it. `mtime` (seconds since the epoch, the server's clock on S3)
    is when it was last written or touched: the farm's last-use mark (storage/usage.py)."""

    path: str
    size: int
    mtime: float
    etag: str | None = None  # S3's tag of the content (a touch keeps it); None on a local store


class Backend(Protocol):
    uri: str

    def read(self, path: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""

    def read_tail(self, path: str, n: int) -> bytes | None:
        """The object's last `n` bytes (all of it when shorter), or None if it does not exist."""

    def write(self, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write atomically. With if_absent, return False (and write nothing) if it exists."""

    def upload_file(self, path: str, src: Path) -> None:
        """Write a local file atomically (multipart for large files on S3)."""

    def download_file(self, path: str, dest: Path) -> bool:
        """Copy the object to dest; False if it does not exist. dest may be partial on error."""

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int | None: ...

    def list(self, prefix: str) -> Iterator[str]:
        """Paths under prefix, in no particular order."""

    def delete(self, path: str) -> None: ...

    def stat(self, path: str) -> ObjectInfo | None:
        """Size and last write (or touch) of one object; None if it does not exist."""

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under prefix with its size and mtime (listing pages, not one call per object)."""

    def touch(self, path: str) -> bool:
        """Make the object's mtime now without changing its bytes; False if it does not exist."""

    def delete_many(self, paths: list[str]) -> None:
        """Delete objects in as few calls as the backend allows (S3: 1000 keys a call)."""
