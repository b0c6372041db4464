"""A unit's log: our own notes plus everything the compiler and libraries print while the
unit runs (g++ errors, Inductor's log, warnings), kept as a blob so a failure can be read
without access to the worker."""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sys
import tempfile
import traceback
import warnings
from typing import Iterator


class UnitLog:
    def __init__(self, title: str):
        self._lines: list[str] = [f"# {title}"]

    def note(self, message: str) -> None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        self._lines.append(f"[{stamp}] {message}")

    def exception(self, e: BaseException) -> None:
        self._lines.append("".join(traceback.format_exception(e)).rstrip())

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Send file descriptors 1 and 2 (so subprocesses too) and torch's INFO log here."""
        # torch's own log handler writes to stderr, which is captured below
        inductor = logging.getLogger("torch._inductor")
        old_level = inductor.level
        with tempfile.TemporaryFile(mode="w+b") as sink:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            inductor.setLevel(logging.INFO)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    logging.captureWarnings(True)
                    yield
            finally:
                logging.captureWarnings(False)
                inductor.setLevel(old_level)
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
                sink.seek(0)
                output = sink.read().decode(errors="replace").rstrip()
                if output:
                    self._lines.append("--- output of the compiler and libraries ---")
                    self._lines.append(output)
                    self._lines.append("--- end of output ---")
