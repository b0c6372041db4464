"""`farm cache-serve`: the farm's store as PyTorch's own remote caches, for training scripts that
call `torch.compile` and never export (storage/cache_server.py; README, "PyTorch's own remote
caches")."""
from __future__ import annotations

import ipaddress
import json
import signal
import socket
from typing import Optional

import typer

from farm.cli_common import StoreOpt, fail, open_store


def cache_serve(
    store: str = StoreOpt,
    tokens: str = typer.Option(..., "--tokens", help="a file of 'NAME ROLE TOKEN' lines, ROLE read or write (chmod 600)"),
    host: str = typer.Option("127.0.0.1", "--host", help="the address to listen on (loopback unless --tls-cert)"),
    port: int = typer.Option(6380, "--port", min=0, max=65535, help="the port to listen on"),
    max_value_mb: float = typer.Option(64.0, "--max-value-mb", help="a larger SET is refused"),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="serve TLS (clients use rediss://) with this "
                                                                    "certificate chain (PEM)"),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="the certificate's private key (PEM)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=1, max=65535, help="serve Prometheus metrics on "
                                               "127.0.0.1:PORT/metrics (farm_remote_cache_*_total, by cache kind)"),
) -> None:
    """Serve the store to stock torch's remote caches until Ctrl-C: set
    TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1 and
    TORCHINDUCTOR_REDIS_URL=redis://NAME:TOKEN@HOST:PORT in the training job."""
    import asyncio

    from farm.console import console
    from storage import StoreError
    from storage.cache_server import CacheServer
    from storage.cache_tokens import TokensError, read_tokens
    from storage.remote_cache import CacheEntries, read_stats

    try:
        users = read_tokens(tokens)
    except TokensError as e:
        raise fail(str(e)) from e
    if max_value_mb <= 0:
        raise fail(f"--max-value-mb {max_value_mb:g}: give a size in MiB above 0")
    tls = checked_tls(tls_cert, tls_key)
    refuse_plaintext(host, tls is not None, "--")
    entries = open_store(store)
    try:  # a store it cannot reach is said now, not as every client's lookup fails
        read_stats(entries)
    except StoreError as e:
        raise fail(f"cannot serve {store}: {e}") from e
    server = CacheServer(CacheEntries(entries), users, host=host, port=port,
                         max_value_bytes=int(max_value_mb * (1 << 20)), tls=tls)
    if metrics_port is not None:
        try:
            _serve_metrics(server, metrics_port)
        except OSError as e:
            raise fail(f"cannot serve metrics on 127.0.0.1:{metrics_port}: {e.strerror or e}; choose another "
                       f"--metrics-port") from e
    scheme = "rediss" if tls else "redis"
    listened: list[int] = []

    def listening(host: str, port: int) -> None:
        listened.append(port)
        console.print(f"farm cache-serve: {store} on {scheme}://NAME:TOKEN@{host}:{port} for {len(users)} users "
                      f"(tokens: {tokens}); Ctrl-C stops")

    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop ends it as Ctrl-C does
    try:
        asyncio.run(server.serve_forever(listening))
    except OSError as e:
        if listened:  # not the listening socket's: a bug, with its traceback
            raise
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port") from e
    except KeyboardInterrupt:
        pass
    finally:
        if listened:
            console.print("farm cache-serve stopped; served " + json.dumps(server.entries.stats()))


def cache_stats(store: str = StoreOpt,
                as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables")) -> None:
    """What each `farm cache-serve` on this store has served since it started: hits, misses,
    refusals, writes and bytes, by cache kind, and their totals."""
    from rich.table import Table

    from farm.console import out
    from storage import StoreError
    from storage.remote_cache import read_stats

    try:
        servers = read_stats(open_store(store, create=False))
    except StoreError as e:
        raise fail(str(e)) from e
    totals: dict[str, dict[str, int]] = {}
    for doc in servers:
        for kind, counts in doc["by_kind"].items():
            for what, n in counts.items():
                totals.setdefault(kind, {}).setdefault(what, 0)
                totals[kind][what] += int(n)
    if as_json:
        typer.echo(json.dumps({"servers": servers, "by_kind": totals}, indent=1))
        return
    if not servers:
        out.print(f"no farm cache-serve has served {store} yet")
        return
    table = Table(title=f"{store}: {len(servers)} cache-serve process(es), last "
                        f"{max(str(d.get('updated_at')) for d in servers)}")
    columns = ("hits", "misses", "refused", "writes", "bytes_read", "bytes_written")
    table.add_column("cache")
    for col in columns:
        table.add_column(col.replace("_", " "), justify="right")
    for kind, counts in sorted(totals.items()):
        table.add_row(kind, *(str(counts.get(c, 0)) for c in columns))
    out.print(table)


def _serve_metrics(server, port: int) -> None:
    """farm_remote_cache_<what>_total{kind=...} on 127.0.0.1:port, read from the server's counts
    at each scrape."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY, CounterMetricFamily

    class Counts:
        def collect(self):
            stats = server.entries.stats()
            for what in ("hits", "misses", "refused", "writes", "bytes_read", "bytes_written"):
                family = CounterMetricFamily(f"farm_remote_cache_{what}", f"farm cache-serve: {what.replace('_', ' ')}, "
                                             f"by cache kind", labels=["kind"])
                for kind, counts in sorted(stats.items()):
                    family.add_metric([kind], counts.get(what, 0))
                yield family

    REGISTRY.register(Counts())
    start_http_server(port, addr="127.0.0.1")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def refuse_plaintext(host: str, tls: bool, flags: str) -> None:
    """Tokens and entries never cross a network in the clear: a non-loopback address needs TLS
    (`flags`: the options' prefix, `--` or `--cache-`)."""
    if not tls and not loopback(host):
        raise fail(f"{flags}host {host} is not a loopback address, and without TLS every token and entry would cross "
                   f"the network in the clear; give {flags}tls-cert and {flags}tls-key (clients then use rediss://), or "
                   f"serve on 127.0.0.1 behind a TLS proxy")


def loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def checked_tls(cert: str | None, key: str | None):
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise fail("--tls-cert and --tls-key go together: give both, or neither for loopback only")
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise fail(f"--tls-cert {cert} / --tls-key {key}: cannot be used ({e})") from e
    return context


def register(app: typer.Typer) -> None:
    app.command("cache-serve")(cache_serve)
    app.command("cache-stats")(cache_stats)
