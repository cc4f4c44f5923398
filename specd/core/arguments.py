"""Command-line value types that refuse impossible numbers where they are parsed.

Contract: `at_least(n)`, `positive_number`, `fraction` and `port_number` are argparse `type=`
callables. A value they refuse raises `argparse.ArgumentTypeError`, which argparse turns into its
own usage line and `error: argument -k: ...` with exit status 2, before anything is loaded: a
negative k or a port past 65535 is never found out by a traceback minutes later. Imports nothing
of specd.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

HIGHEST_PORT = 65535


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def at_least(lowest: int, highest: int | None = None) -> Callable[[str], int]:
    """A whole number no smaller than `lowest` (and, when given, no larger than `highest`)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"must be at most {highest}, got {value}")
        return value

    return parse


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number above 0 (seconds, MiB, GiB)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def non_negative_number(text: str) -> float:
    """A finite number, 0 or above (0 usually meaning off)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of something: above 0, at most 1."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def pull_share(text: str) -> float:
    """A share of the way back per step: 0 (off) up to, not including, 1."""
    value = _finite(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port: 1-65535, or 0 for any free one."""
    value = _integer(text)
    if not 0 <= value <= HIGHEST_PORT:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0-{HIGHEST_PORT} (0: any free one), got {value}")
    return value
