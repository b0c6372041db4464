"""What the tests of `farm cache-serve` share: a tokens file of one writer and one reader (the
`tokens` fixture, tests/conftest.py), and an in-process endpoint on a store
(tests/test_cache_endpoint.py: the endpoint itself; tests/test_remote_cache.py: torch and
use_farm_cache through it)."""
from __future__ import annotations

from pathlib import Path

from storage import store_from_uri
from storage.cache_server import CacheServer
from storage.cache_tokens import read_tokens
from storage.remote_cache import CacheEntries

WRITER, READER = "w" * 24, "r" * 24


def write_tokens(path: Path) -> Path:
    """A tokens file at `path`: `ci` writes (WRITER), `alice` reads (READER)."""
    path.write_text(f"# who may use the cache\nci write {WRITER}\nalice read {READER}  # a training job\n")
    path.chmod(0o600)
    return path


def serve(store_uri: str, tokens: Path, **kw) -> CacheServer:
    """An endpoint on the store, serving from a thread of this process until `stop()`."""
    server = CacheServer(CacheEntries(store_from_uri(store_uri)), read_tokens(tokens), **kw)
    server.start_in_thread()
    return server
