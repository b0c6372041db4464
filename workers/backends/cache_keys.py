"""What AOTAutograd's cache keys are made of, part by part, so that a process that misses a
shipped bundle can say why instead of compiling in silence.

AOTAutograd hashes every part of a graph's key (the graph, its inputs' metadata, each Inductor
and autograd setting, torch's sources) and logs each part's hash at DEBUG. The producer keeps
those hashes beside the bundle; a consumer that computes a key the bundle lacks compares its
own parts with the closest recorded key and names the parts that differ.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import re
import threading
from typing import Any, Iterator

LOGGER = "torch._functorch._aot_autograd.autograd_cache"
_PART = re.compile(r"\[(\w+)\] ([^:\n]+): ")
HASH_CHARS = 12  # enough to tell two parts apart; keeps a bundle's record small
_PLAIN = (bool, int, float, str, type(None))

Parts = dict[str, str]  # part name (`inductor_config[cpp.march]`, `gm`, ...) -> its hash


def parts(details: str) -> Parts:
    """The parts of one key from AOTAutograd's debug lines (continuation lines of a multi-line
    value, the graph's code for one, are skipped: its first line carries the part's hash)."""
    found: Parts = {}
    for line in details.splitlines():
        m = _PART.match(line)
        if m:
            found[m.group(2)] = m.group(1)[:HASH_CHARS]
    return found


def _digest(value: object) -> str:
    return hashlib.sha256(pickle.dumps(value, protocol=2)).hexdigest()[:HASH_CHARS]  # torch pickled it already


def _autograd_config() -> dict[str, Any]:
    from torch._functorch import config

    return pickle.loads(config.save_config())  # this process's own settings, pickled by torch


def autograd_settings() -> Parts:
    """Each AOTAutograd setting's hash, as the key just computed saw them. AOTAutograd hashes
    them all as one part (`autograd_config`), which tells a miss that some setting differs but
    not which; the recorder runs in the thread and context that computed the key, so these are
    the values that went into it."""
    return {f"autograd_config[{name}]": _digest(value) for name, value in _autograd_config().items()}


def autograd_values() -> dict[str, Any]:
    """This process's AOTAutograd settings that a bundle's facts can carry (plain values), for
    `settings_to_pin` at load."""
    return {name: value for name, value in _autograd_config().items()
            if not name.startswith("_save_config") and isinstance(value, _PLAIN)}


def settings_to_pin(recorded: object) -> dict[str, Any]:
    """The AOTAutograd settings a consumer holds around its calls so that its keys are the
    producer's: those of `recorded` (a bundle's `autograd_config`) whose value here differs and
    that this process left at torch's default. Some defaults come from the environment
    (`error_on_custom_op_aliasing` is on wherever `CI` is set, and the sandbox passes no `CI`), so
    a consumer on a CI runner missed every graph. A setting the user chose (in code or its
    environment variable) is theirs: kept, and a miss names it."""
    from torch._functorch import config

    is_default = getattr(config, "_is_default", None)
    if not isinstance(recorded, dict) or is_default is None:
        return {}
    here = autograd_values()
    return {name: value for name, value in recorded.items()
            if name in here and type(value) is type(here[name]) and value != here[name] and is_default(name)}


class _Recorder(logging.Handler):
    def __init__(self, keys: dict[str, Parts]) -> None:
        super().__init__(logging.DEBUG)
        self.keys = keys

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Autograd graph cache hash details") and isinstance(record.args, tuple) \
                and len(record.args) == 2:
            key, details = record.args
            self.keys[str(key)] = {**parts(str(details)), **autograd_settings()}


@contextlib.contextmanager
def recording(keys: dict[str, Parts] | None = None) -> Iterator[dict[str, Parts]]:
    """Collect, into `keys`, the parts of every AOTAutograd key computed inside (only a compile
    computes one: a call that compiles nothing costs a level check). The DEBUG records stay
    here unless this logger was already at DEBUG (someone asked to see them)."""
    keys = {} if keys is None else keys
    logger = logging.getLogger(LOGGER)
    handler = _Recorder(keys)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    try:
        yield keys
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


_active = threading.local()  # this thread's `recording_compiles` (its keys, and the recording while Dynamo compiles)
_callbacks_installed = False


def _compile_started(_args: object) -> None:
    keys = getattr(_active, "keys", None)
    if keys is not None and getattr(_active, "recording", None) is None:
        stack = contextlib.ExitStack()
        stack.enter_context(recording(keys))
        _active.recording = stack


def _compile_ended(_args: object) -> None:
    stack = getattr(_active, "recording", None)
    if stack is not None:
        _active.recording = None
        stack.close()


@contextlib.contextmanager
def recording_compiles() -> Iterator[dict[str, Parts]]:
    """`recording`, switched on by Dynamo's compile callbacks only while Dynamo compiles: around
    every training step, a call that compiles nothing costs a thread-local store instead of two
    changes of logging's levels (which clear every logger's cache under logging's global lock)."""
    global _callbacks_installed
    if not _callbacks_installed:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(_compile_started)
        callback_handler.register_end_callback(_compile_ended)
        _callbacks_installed = True
    keys: dict[str, Parts] = {}
    outer = getattr(_active, "keys", None)
    _active.keys = keys
    try:
        yield keys
    finally:
        _active.keys = outer


def why_missed(key: str, seen: Parts, recorded: dict[str, Parts]) -> str:
    """Why the key this process computed found nothing in the bundle: the parts where it differs
    from the closest key the bundle was built with, or that the key was there (so the entry itself
    was refused: its shape guards, or an FX graph it names is missing)."""
    if key in recorded:
        return f"key {key[:16]}… is in the bundle, but its entry was refused (its shape guards, or a graph it names is missing)"
    if not recorded:
        return f"key {key[:16]}… is not in the bundle, which records no keys (built by an older farm)"

    def differing(other: Parts) -> list[str]:
        names = sorted(n for n in set(seen) | set(other) if seen.get(n) != other.get(n)
                       if not n.startswith("autograd_config[") or (n in seen and n in other))  # older bundles lack these
        named = [n for n in names if n != "autograd_config"]  # the settings that differ say more than their sum
        return named if any(n.startswith("autograd_config[") for n in named) else names

    closest = min(recorded.values(), key=lambda other: len(differing(other)))
    names = differing(closest)
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return f"key {key[:16]}… is not in the bundle; it differs from the closest key the bundle was built with in: {shown}"
