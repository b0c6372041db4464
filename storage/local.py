"""A store in a local directory. Every write goes to a temp file first, then is renamed
(or hard-linked, for a conditional write) into place, so a reader never sees half a file; a write
that fails (a full disk) removes its temp file and raises StoreError, as the S3 backend does."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from storage.backend import NoSuchStore, ObjectInfo, StoreError, StoreUnwritable

# a write that fails with these fails again in a moment: the unit is not run again for them
UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


class LocalBackend:
    def __init__(self, root: str | Path, create: bool = True):
        """`create`: make the directory if it is missing (the first job that writes to a store
        makes it); without, a missing one is NoSuchStore (what only reads makes nothing)."""
        self.root = Path(root).expanduser().resolve()
        self.uri = f"file://{self.root}"
        if not create and not self.root.is_dir():
            raise NoSuchStore(f"no store at {self.root}: no such directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store directory {self.root}: {e}") from e

    def _path(self, path: str) -> Path:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"store path must be relative without '..': {path!r}")
        return self.root / path

    @contextlib.contextmanager
    def _failing_as_store(self, what: str, path: str, writing: bool = True) -> Iterator[None]:
        """An OSError inside (but a missing file, which each read answers itself) as StoreError,
        naming the store's path: a disk that fails, a mount gone stale (NFS) or a file not ours
        to read is the store's problem, said as S3's are, never a traceback."""
        try:
            yield
        except OSError as e:
            full = writing and e.errno in (errno.ENOSPC, errno.EDQUOT)
            hint = " (its disk is full: free space there, or run `farm gc`)" if full else ""
            kind = StoreUnwritable if writing and e.errno in UNWRITABLE else StoreError
            raise kind(f"{what} {self.uri}/{path} failed: {e.strerror or e}{hint}") from e

    def _temp_beside(self, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        return Path(tmp)

    def _place(self, tmp: Path, dest: Path, if_absent: bool) -> bool:
        try:
            if if_absent:
                try:
                    os.link(tmp, dest)  # fails if dest exists: the O_EXCL of renames
                except FileExistsError:
                    return False
                return True
            os.replace(tmp, dest)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def read(self, path: str) -> bytes | None:
        with self._failing_as_store("read", path, writing=False):
            try:
                return self._path(path).read_bytes()
            except FileNotFoundError:
                return None

    def read_tail(self, path: str, n: int) -> bytes | None:
        with self._failing_as_store("read", path, writing=False):
            try:
                with open(self._path(path), "rb") as f:
                    f.seek(max(0, f.seek(0, os.SEEK_END) - n))
                    return f.read(n)
            except FileNotFoundError:
                return None

    def write(self, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        def fill(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        return self._put("write", path, fill, if_absent)

    def upload_file(self, path: str, src: Path) -> None:
        self._put("upload", path, lambda tmp: shutil.copyfile(src, tmp), if_absent=False)

    def _put(self, what: str, path: str, fill: Callable[[Path], object], if_absent: bool) -> bool:
        """A temp file beside `path`, filled, then put in place; on failure, removed."""
        dest = self._path(path)
        with self._failing_as_store(what, path):
            if if_absent and dest.exists():
                return False
            tmp = self._temp_beside(dest)
            try:
                fill(tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return self._place(tmp, dest, if_absent)

    def download_file(self, path: str, dest: Path) -> bool:
        src = self._path(path)
        with self._failing_as_store("read", path, writing=False):  # the store's side; dest's errors are the caller's
            try:
                src.open("rb").close()
            except FileNotFoundError:
                return False
        try:
            shutil.copyfile(src, dest)
        except FileNotFoundError:
            return False
        return True

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def size(self, path: str) -> int | None:
        info = self.stat(path)
        return None if info is None else info.size

    def list(self, prefix: str) -> Iterator[str]:
        return (info.path for info in self.list_info(prefix))

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        start = base if base.is_dir() else base.parent
        if not start.exists():
            return
        for dirpath, _, files in os.walk(start):
            for name in files:
                if name.startswith("."):
                    continue  # temp files of writes in flight
                path = Path(dirpath, name)
                rel = path.relative_to(self.root).as_posix()
                if rel.startswith(prefix):
                    try:
                        st = path.stat()
                    except FileNotFoundError:  # deleted while we walked
                        continue
                    yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def stat(self, path: str) -> ObjectInfo | None:
        with self._failing_as_store("stat", path, writing=False):
            try:
                st = self._path(path).stat()
            except (FileNotFoundError, NotADirectoryError):
                return None
        return ObjectInfo(path, st.st_size, st.st_mtime)

    def touch(self, path: str) -> bool:
        with self._failing_as_store("touch", path):
            try:
                os.utime(self._path(path))
            except FileNotFoundError:
                return False
            return True

    def delete(self, path: str) -> None:
        with self._failing_as_store("delete", path):
            self._path(path).unlink(missing_ok=True)

    def delete_many(self, paths: list[str]) -> None:
        for path in paths:
            self.delete(path)
