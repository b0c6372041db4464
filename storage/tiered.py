"""A bounded local disk cache of blobs in front of a remote store.

Blobs are content-addressed and immutable, so a copy on the worker's disk never goes stale;
only blobs are cached (manifests, leases and job files always go to the remote store, since
their absence is news). A cached copy is still checked against its digest before it is
handed out, like any download, and a damaged one is dropped and fetched again. Several
worker processes on one host may share the directory: entries appear by rename, and
eviction (least recently used first, by mtime, which every use refreshes) tolerates files
vanishing under it.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from storage.backend import Backend
from storage.store import BlobRef, Store, sha256_file

log = logging.getLogger(__name__)
DEFAULT_CACHE_BYTES = 20 << 30


@dataclass(frozen=True)
class CacheConfig:
    directory: Path
    max_bytes: int = DEFAULT_CACHE_BYTES

    @classmethod
    def from_env(cls) -> "CacheConfig | None":
        """FARM_CACHE_DIR (default ~/.cache/pt2-farm/blobs; 'off' disables) and FARM_CACHE_GB (default 20)."""
        where = os.environ.get("FARM_CACHE_DIR", "~/.cache/pt2-farm/blobs")
        if where.lower() in ("off", "none", "0", ""):
            return None
        gb = os.environ.get("FARM_CACHE_GB", "")
        try:
            max_bytes = int(float(gb) * (1 << 30)) if gb else DEFAULT_CACHE_BYTES
        except ValueError as e:
            raise ValueError(f"FARM_CACHE_GB={gb!r} is not a number of GiB") from e
        return cls(Path(where).expanduser(), max_bytes)


class LocalBlobCache:
    def __init__(self, config: CacheConfig):
        self.root, self.max_bytes = config.directory, config.max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def copy_out(self, digest: str, dest: Path) -> bool:
        """Put the cached blob at dest (a hard link where possible); False if not cached."""
        src = self._path(digest)
        try:
            os.utime(src)  # a use: keeps it young for eviction
            dest.unlink(missing_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copyfile(src, dest)
        except FileNotFoundError:
            return False
        return True

    def add(self, src: Path, digest: str) -> None:
        """Keep a copy, if the disk lets it: a cache that cannot take one (its disk full) costs a
        download later, never the unit that was uploading or fetching it."""
        dest = self._path(digest)
        try:
            if dest.exists():
                os.utime(dest)
                return
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{digest[:12]}.", suffix=".tmp")
            os.close(fd)
            try:
                shutil.copyfile(src, tmp)
                os.replace(tmp, dest)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError as e:
            log.warning("local blob cache %s: %s not kept (%s)", self.root, digest[:12], e.strerror or e)
            return
        self.evict()

    def drop(self, digest: str) -> None:
        self._path(digest).unlink(missing_ok=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        found = []
        for path in self.root.glob("??/*"):
            if path.name.startswith("."):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, st.st_size, path))
        return found

    def size(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self) -> None:
        entries = sorted(self.entries(), key=lambda e: e[0])
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


class TieredStore(Store):
    """A Store whose blob reads go through a LocalBlobCache first."""

    def __init__(self, backend: Backend, cache: LocalBlobCache):
        super().__init__(backend)
        self.cache = cache

    def fetch(self, digest: str, dest: Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.cache.copy_out(digest, dest):
            if sha256_file(dest) == digest:
                self.transfer.cached += dest.stat().st_size
                return dest
            self.cache.drop(digest)  # damaged on disk: never hand it out, fetch it again
            dest.unlink(missing_ok=True)
        super().fetch(digest, dest)
        self.cache.add(dest, digest)
        return dest

    def put_file(self, src: Path) -> BlobRef:
        ref = super().put_file(src)
        self.cache.add(Path(src), ref.digest)  # what a worker just built is what it may load next
        return ref
