"""specd's services cap glibc's malloc arenas (specd/core/allocator.py), and leave an operator's setting alone.

Each case runs in a fresh interpreter: the cap holds for arenas made after it, and it writes the
environment. The arenas are counted from glibc's own report (`malloc_info`), after eight threads
allocate at once; uncapped, glibc gives each of them an arena of its own (up to 8 per core).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, ctypes.util, json, os, sys, tempfile, threading
from specd.core.allocator import cap_malloc_arenas
said = cap_malloc_arenas() if sys.argv[1] == "cap" else "not asked"
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
together = threading.Barrier(8)
def allocate():
    together.wait()  # all alive at once: a thread that ended would hand its arena to the next
    libc.malloc(4096)
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, f); libc.fclose(f)
heaps = open(path).read().count("<heap nr=")
os.unlink(path)
child = os.popen(sys.executable + " -c 'import os; print(os.environ.get(\"MALLOC_ARENA_MAX\"))'").read().strip()
print(json.dumps({"said": said, "heaps": heaps, "child_sees": child}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas: Linux only")


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={**clean, **env})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_the_cap_holds_a_process_to_two_arenas_and_its_children_inherit_it() -> None:
    capped, uncapped = probe("cap"), probe("none")
    assert capped["said"] == "capped"
    assert capped["heaps"] <= 2
    assert uncapped["heaps"] > 2  # without it, the eight threads did get arenas of their own
    assert capped["child_sees"] == "2" and uncapped["child_sees"] == "None"


def test_an_operators_malloc_arena_max_is_left_alone() -> None:
    result = probe("cap", MALLOC_ARENA_MAX="6")
    assert result["said"] == "set by the environment"
    assert result["child_sees"] == "6"
    assert 2 < result["heaps"] <= 6
