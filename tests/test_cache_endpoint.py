"""`farm cache-serve` itself, without torch: what it counts and serves from the command line;
hostile clients get an error or are closed while the server goes on serving; its request parser
is bounded (fuzzed); tokens files it cannot use and a store it cannot reach are said at once; an
entry whose value is gone is a miss. (Torch and use_farm_cache through it: tests/test_remote_cache.py.)"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage import store_from_uri
from storage.cache_tokens import TokensError, read_tokens
from storage.remote_cache import CacheEntries, index_path
from storage.resp import Limits, ProtocolError, read_request
from tests.cache_endpoint import READER, WRITER, serve
from tests.cli import farm
from tests.sockets import accepts, free_port

ROOT = Path(__file__).resolve().parents[1]


def test_cache_serve_from_the_command_line_counts_what_it_served_in_metrics_and_cache_stats(tokens, tmp_path):
    import redis
    import urllib.request

    store = str(tmp_path / "store")
    port, metrics = (free_port() for _ in range(2))
    proc = subprocess.Popen([sys.executable, "-m", "farm", "cache-serve", "--store", store, "--tokens", str(tokens),
                             "--port", str(port), "--metrics-port", str(metrics)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not accepts(port):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        writer = redis.Redis.from_url(f"redis://ci:{WRITER}@127.0.0.1:{port}")
        reader = redis.Redis.from_url(f"redis://alice:{READER}@127.0.0.1:{port}")
        key = "pt2:fx-graph-v1::cli:c1"
        assert writer.set(key, b"v" * 1000) and reader.get(key) == b"v" * 1000 and reader.get(key + "x") is None
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set(key, b"no")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'farm_remote_cache_hits_total{kind="fx-graph-v1"} 1.0' in text, text[-2000:]
        assert 'farm_remote_cache_refused_total{kind="fx-graph-v1"} 1.0' in text
    finally:
        proc.terminate()
        said = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "farm cache-serve stopped" in said, said
    stats = json.loads(farm("cache-stats", "--store", store, "--json"))
    assert stats["by_kind"]["fx-graph-v1"] == {"writes": 1, "bytes_written": 1000, "hits": 1, "bytes_read": 1000,
                                               "misses": 1, "refused": 1}, stats
    assert "fx-graph-v1" in farm("cache-stats", "--store", store)


# hostile clients ---------------------------------------------------------------------
class _Client:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, *args: bytes) -> None:
        self.sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))

    def reply(self) -> bytes:
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_hostile_clients_get_an_error_or_are_closed_and_the_server_serves_on(tokens, tmp_path):
    server = serve(str(tmp_path / "store"), tokens, max_value_bytes=1 << 20)
    key = b"pt2:fx-graph-v1::k:c1"
    try:
        c = _Client(server.port)  # no AUTH: nothing but AUTH and HELLO
        c.send(b"GET", key)
        assert c.reply().startswith(b"-NOAUTH")
        c.send(b"SET", key, b"v")
        assert c.reply().startswith(b"-NOAUTH")
        c.send(b"AUTH", b"alice", b"x" * 24)
        assert c.reply().startswith(b"-WRONGPASS")
        c.sock.sendall(b"*2\r\n$3\r\nGET\r\n$100000\r\n")  # a bulk string over the unauthenticated limit
        assert c.reply().startswith(b"-ERR Protocol error") and c.closed()

        c = _Client(server.port)
        c.sock.sendall(b"GET k\r\n")  # inline commands are not served
        assert b"inline" in c.reply() and c.closed()
        c = _Client(server.port)
        c.sock.sendall(b"*1\r\n$x\r\n")  # malformed
        assert c.reply().startswith(b"-ERR Protocol error") and c.closed()

        r = _Client(server.port)
        r.send(b"AUTH", b"alice", READER.encode())
        assert r.reply() == b"+OK\r\n"
        r.send(b"SET", key, b"v")  # a reader may not write
        assert r.reply().startswith(b"-NOPERM")
        r.send(b"FLUSHALL")
        assert r.reply().startswith(b"-ERR unknown command 'FLUSHALL'")
        r.send(b"FARM.PUT", key, b"v", b"{}")
        assert r.reply().startswith(b"-NOPERM")

        w = _Client(server.port)
        w.send(b"AUTH", b"ci", WRITER.encode())
        assert w.reply() == b"+OK\r\n"
        w.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$2000000\r\n" % (len(key), key))  # over --max-value-mb
        assert w.reply().startswith(b"-ERR Protocol error") and w.closed()
        w = _Client(server.port)
        w.send(b"AUTH", b"ci", WRITER.encode())
        assert w.reply() == b"+OK\r\n"
        w.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1000\r\n%s" % (len(key), key, b"x" * 10))
        w.sock.close()  # gone mid-value: nothing of it is kept

        good = _Client(server.port)  # the server went on
        good.send(b"AUTH", b"ci", WRITER.encode())
        assert good.reply() == b"+OK\r\n"
        good.send(b"GET", key)
        assert good.reply() == b"$-1\r\n"
        good.send(b"FARM.PUT", key, b"value", b"{}", b"../../etc/evil.so", b"\x7fELF")  # a kernel's name escaping
        assert good.reply().startswith(b"-ERR FARM.PUT with file names that are not Inductor's")
        good.send(b"SET", key, b"value")
        assert good.reply() == b"+OK\r\n"
        r.send(b"GET", key)
        assert r.reply() == b"$5\r\nvalue\r\n"

        # a kernel sent once is named by its blob in later entries; a blob the store lacks is refused
        kernel, elf = b"ab/c" + b"b" * 30 + b".main.so", b"\x7fELF kernel"
        blob = b"sha256:%s:%d" % (hashlib.sha256(elf).hexdigest().encode(), len(elf))
        good.send(b"FARM.PUT", b"pt2:fx-graph-v1::k2:c1", b"v2", b"{}", kernel, blob)
        assert good.reply().startswith(b"-ERR FARM.PUT names ab/c")  # and the connection serves on
        good.send(b"FARM.PUT", b"pt2:fx-graph-v1::k2:c1", b"v2", b"{}", kernel, elf)
        assert good.reply() == b"+OK\r\n"
        good.send(b"FARM.PUT", b"pt2:fx-graph-v1::k3:c1", b"v3", b"{}", kernel, blob)
        assert good.reply() == b"+OK\r\n"
        _, doc, _ = server.entries.entry(b"pt2:fx-graph-v1::k3:c1", verify=False)
        assert server.entries.files(doc) == {kernel.decode(): elf}
    finally:
        server.stop()
    assert server.entries.stats()["fx-graph-v1"]["refused"] == 3  # the reader's SET and FARM.PUT, the bad name


def test_the_request_parser_bounds_what_it_reads_and_raises_only_protocol_errors():
    rng = random.Random(0)
    good = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n"
    limits = Limits(line_bytes=64, args=4, arg_bytes=16)

    async def parse(data: bytes):
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while True:
            request = await read_request(reader, limits)
            if request is None:
                return out
            out.append(request)

    assert asyncio.run(parse(good + good)) == [[b"SET", b"key", b"value"]] * 2
    for data in (b"*5\r\n", b"*1\r\n$17\r\n", b"*1\r\n$-1\r\n", b"*" + b"9" * 80 + b"\r\n", b"*1\r\n$3\r\nGETxx"):
        with pytest.raises(ProtocolError):
            asyncio.run(parse(data))
    for _ in range(2000):  # mutated requests: parsed, or a ProtocolError; never anything else
        data = bytearray(good * 2)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            asyncio.run(parse(bytes(data[:rng.randint(0, len(data))])))
        except ProtocolError:
            pass


def test_a_tokens_file_that_cannot_be_used_is_refused_with_its_line(tmp_path):
    path = tmp_path / "tokens"
    for text, said in ((f"ci admin {WRITER}\n", "line 1: the role 'admin'"), ("\nci write short\n", "line 2: ci's token is shorter"),
                       (f"ci write {WRITER}\nci read {READER}\n", "line 2: ci is named twice"),
                       ("ci write\n", "expected 'NAME ROLE TOKEN'"), ("# nobody\n", "no users")):
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(TokensError, match=said):
            read_tokens(path)
    path.write_text(f"ci write {WRITER}\n")
    path.chmod(0o644)
    with pytest.raises(TokensError, match="others may read it.*chmod 600"):
        read_tokens(path)
    assert "chmod 600" in farm("cache-serve", "--store", str(tmp_path / "store"), "--tokens", str(path))
    path.chmod(0o600)
    said = farm("cache-serve", "--store", str(tmp_path / "store"), "--tokens", str(path), "--host", "0.0.0.0")
    assert "not a loopback address" in said and "--tls-cert" in said


def test_cache_serve_on_a_port_in_use_says_so_and_never_that_it_serves(tokens, tmp_path):
    """Before, it said where it served, then that it could not listen there, then that it stopped."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "farm", "cache-serve", "--store", str(tmp_path / "store"),
                               "--tokens", str(tokens), "--port", str(port)], cwd=ROOT, text=True, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in said and "another --port" in said, said
    assert "Ctrl-C stops" not in said and "stopped" not in said, said


def test_cache_serve_says_at_once_that_it_cannot_reach_its_store(tokens, tmp_path):
    """Not a server that listens, then answers every lookup with an error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    done = subprocess.run([sys.executable, "-m", "farm", "cache-serve", "--store", "s3://no-such-bucket/cache",
                           "--tokens", str(tokens), "--port", str(free_port())], cwd=ROOT, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 2 and "cannot serve s3://no-such-bucket/cache" in said, said
    assert "Unable to locate credentials" in said and "on redis://" not in said


def test_an_entry_whose_value_is_gone_is_a_miss_not_an_error(tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    entries = CacheEntries(store)
    key = b"pt2:fx-graph-v1::k:c1"
    entries.put(key, b"value", "ci")
    doc = store.get_document(index_path(key))
    store.backend.delete_many([f"blobs/sha256/{doc['blob']['digest'][:2]}/{doc['blob']['digest']}"])
    assert entries.get(key) is None and entries.stats()["fx-graph-v1"]["refused"] == 1
