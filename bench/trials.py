"""A benchmark's sides run in turn: trial after trial, the order swapped every other time, so
that what drifts over one run (caches warming, the machine's other load) falls on both sides
alike. One run of bench/shared.py's nightlies got faster as it went on (39.7, 37.3, 35.7 s)."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def in_turn(trial: int, sides: dict[str, Callable[[], T]]) -> dict[str, T]:
    """Each side's result, by name: the sides run in the given order on even trials (0, 2, ...)
    and in reverse on odd ones."""
    names = list(sides) if trial % 2 == 0 else list(sides)[::-1]
    return {name: sides[name]() for name in names}
