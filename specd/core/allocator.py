"""glibc's malloc arenas capped for specd's long-running services (`specd serve`, `specd learner`).

Contract: `cap_malloc_arenas()` makes this process use at most `ARENAS` malloc arenas (glibc's
`mallopt(M_ARENA_MAX)`) and sets `MALLOC_ARENA_MAX` in the environment so that the processes it
starts (a server's learner process) do the same. It does nothing where the environment already
sets `MALLOC_ARENA_MAX` (an operator's choice wins) or the C library is not glibc, and says which
in its return value: "capped", "set by the environment" or "not glibc". Call it before the
service starts its threads: the cap holds for arenas made after it.

Why: glibc gives each thread that allocates while another holds an arena an arena of its own,
up to 8 per core, and memory freed into one arena goes back to the system only from that
arena's top. A server's engine thread, event loop and MQTT threads all allocate, and its
resident memory crept up over long soaks. Two servers under the same traffic, one capped and one
at glibc's default (benchmarks/server_memory.py, five paired runs of 10-25 minutes,
docs/measurements.md): the capped one ended 8 to 143 MB lower and grew less after warm-up in each
run (+78 to +103 MB against +90 to +197 MB), answering as many requests (-2.5% to +0.6%). Both
still grow: the cap trims the creep, it does not end it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h


def cap_malloc_arenas(arenas: int = ARENAS) -> str:
    if "MALLOC_ARENA_MAX" in os.environ:
        return "set by the environment"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):   # no C library found by name, or one without mallopt
        return "not glibc"
    if not mallopt(M_ARENA_MAX, arenas):
        return "not glibc"
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)
    return "capped"
