"""Thread helpers shared by every layer that runs background work beside decoding.

Contract: `lower_thread_priority` makes the calling thread (and threads it starts, e.g. its
OpenMP team) yield to decoding on Linux, which keeps a nice value per thread; elsewhere it
quietly does nothing. Imports nothing of specd.
"""

from __future__ import annotations

import contextlib
import os
import threading


def lower_thread_priority(niceness: int = 10) -> None:
    """Renice the calling thread so that decoding wins whenever both want a core."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
