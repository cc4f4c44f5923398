"""One learner per store (and per spool): a second one would publish into the same store and
number records into the same spool, which drops some of them as duplicates. (A pretraining run
holds its work folder the same way: two would write the same checkpoints.)

Contract: `claim(folder, advice)` takes an exclusive, non-blocking lock on `folder/learner.lock` and
writes this process's pid into it; it raises `StoreError` naming the holder's pid when another
process (or another claim in this one) holds it. The lock lasts until `release()` or until the
process ends (the kernel drops it with the file), so a learner killed with -9 never leaves a
stale claim behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

from specd.core.errors import StoreError

LOCK_NAME = "learner.lock"


class LearnerClaim:
    def __init__(self, handle: TextIO) -> None:
        self._handle: TextIO | None = handle

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


def claim(folder: str | Path, advice: str, what: str = "learner", lock_name: str = LOCK_NAME,
          per: str = "store") -> LearnerClaim:
    """Hold `folder` for this learner (or another `what`, under its own `lock_name`: a pretraining run
    holds its work folder); StoreError (ending with `advice`) if another one holds it."""
    path = Path(folder) / lock_name
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StoreError(f"another {what} (pid {holder}) is running on {folder}: one {what} per {per}; "
                         f"{advice}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return LearnerClaim(handle)
