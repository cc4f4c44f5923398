"""Files written whole or not at all.

Contract: `write_text_atomic(path, text)` writes `text` to a temporary file beside `path` and renames
it over `path`, so a reader sees the old file or the new one, never a part; when the write fails
(a full disk) the temporary file is removed and the error raised, so nothing half-written is left
behind. `fsync=True` also flushes the file to the disk before the rename (what a store's manifests
need to survive a power cut).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str, fsync: bool = False) -> None:
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
