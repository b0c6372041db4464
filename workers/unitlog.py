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
import threading
import traceback
import warnings
from typing import Iterator

# File descriptors 1 and 2, Inductor's loggers and the warnings filters are the process's, so one
# unit at a time may redirect them: units of jobs run at once in threads (in-process jobs, the
# farm service's scheduler) each saved and restored what the other had set, and left fd 2 on a
# unit's deleted temp file and Inductor's log on its closed stream.
_capturing = threading.Lock()


class UnitLog:
    def __init__(self, title: str):
        self._lines: list[str] = [f"# {title}"]

    def note(self, message: str) -> None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        self._lines.append(f"[{stamp}] {message}")

    def exception(self, e: BaseException) -> None:
        self._lines.append("".join(traceback.format_exception(e)).rstrip())

    def output(self, text: str, source: str = "the compiler and libraries") -> None:
        text = text.rstrip()
        if text:
            self._lines += [f"--- output of {source} ---", text, "--- end of output ---"]

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Send file descriptors 1 and 2 (so subprocesses and C++ too), Inductor's INFO log
        and Python warnings here; while another thread's unit has them, this unit's log keeps
        only what its sandbox says (the step's own output comes back with its reply)."""
        if not _capturing.acquire(blocking=False):
            yield
            return
        try:
            with self._process_output():
                yield
        finally:
            _capturing.release()

    @contextlib.contextmanager
    def _process_output(self) -> Iterator[None]:
        with tempfile.TemporaryFile(mode="w+b") as sink:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            # Our own handler on fd 2: sys.stderr may not be fd 2 (pytest, notebooks).
            stream = os.fdopen(os.dup(2), "w", buffering=1)
            handler = logging.StreamHandler(stream)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            loggers = [logging.getLogger("torch._inductor"), logging.getLogger("py.warnings")]
            saved_state = [(lg.level, lg.propagate, lg.handlers[:]) for lg in loggers]
            for lg in loggers:
                lg.handlers = [handler]  # torch's own handler would print each line twice
                lg.setLevel(logging.INFO)
                lg.propagate = False
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    logging.captureWarnings(True)
                    yield
            finally:
                logging.captureWarnings(False)
                for lg, (level, propagate, handlers) in zip(loggers, saved_state):
                    lg.handlers = handlers
                    lg.setLevel(level)
                    lg.propagate = propagate
                stream.close()
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
                sink.seek(0)
                self.output(sink.read().decode(errors="replace"))
