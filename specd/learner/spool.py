"""The learner sidecar's record spool: what a restarted learner reloads, bounded on disk and in memory.

Contract:
- `add(record)` stores a record that has a `record_id` unless that id is among the most recent
  `dedup_window` ids (QoS 1 redelivers recent messages only), and returns whether it was new.
  It returns once the record is written to the operating system (flushed, not fsync'd): a
  process killed right after loses nothing; a machine that loses power may lose the last writes.
- Two append-only files in `folder`: `received.jsonl` (one record per line) and
  `received-ids.jsonl` (one `[n, record_id]` per new record, n counting every new record ever
  received). The id log keeps the duplicate filter and `records_in` (the cumulative count of
  unique records) across restarts and across compaction of the spool.
- Both files are compacted, never grown without bound: the spool keeps the newest `keep()`
  records (what the learner's bounded buffers and the bus can still use), within `max_bytes`
  (the newest that fit in half of it, so compaction stays rare); the id log keeps the newest
  `dedup_window` ids. A compaction writes a new file, fsyncs it and renames it over the old one:
  a crash at any point leaves either the old file or the new one, never a mix.
- `load()` (once, at start) restores the filter and the count, and returns the spool's records
  for the learner to take again. A record whose id line a crash cut off (the spool is written
  first) is counted then, so the count never misses a record the spool holds.
Single writer: one task calls `add` and `compact`; `records_in` may be read from anywhere.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpoolConfig:
    max_bytes: int = 1 << 30         # the spool file's bound on disk (feature records are ~5 KB a token)
    dedup_window: int = 200_000      # recent record ids kept to drop QoS 1 redeliveries

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.dedup_window < 1:
            raise ValueError(f"spool bounds must be positive, got {self}")


class RecordSpool:
    def __init__(self, folder: str | Path, config: SpoolConfig, keep: Callable[[], int]) -> None:
        self.folder = Path(folder)
        self.config = config
        self.keep = keep                              # records the learner can still use, asked at compaction
        self.path = self.folder / "received.jsonl"
        self.ids_path = self.folder / "received-ids.jsonl"
        self.records_in = 0                           # unique records ever received, across restarts
        self.duplicates = 0                           # redeliveries dropped since start
        self.compactions = 0
        self.dropped_for_space = 0                    # records compaction wanted to keep but max_bytes did not fit
        self._recent: deque[str] = deque()            # the duplicate filter, oldest first ...
        self._recent_set: set[str] = set()            # ... and the same ids for lookups
        self.num_records = 0                          # lines in the spool file
        self.num_bytes = 0                            # the spool file's size
        self._num_id_lines = 0
        self._spool: IO[str] | None = None
        self._ids: IO[str] | None = None

    # ---- start ------------------------------------------------------------------------------
    def load(self) -> list[dict[str, Any]]:
        """Restore the filter and the count from disk; the spool's records, oldest first."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.ids_path):
            _end_cut_line(path)
        for line in _lines(self.ids_path):
            try:
                number, record_id = json.loads(line)
            except (ValueError, TypeError):
                continue  # a line cut by a crash mid-write
            self._remember(str(record_id))
            self.records_in = max(self.records_in, int(number))
            self._num_id_lines += 1
        records = []
        for line in _lines(self.path):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("record_id") is not None:
                records.append(record)
                self.num_bytes += len(line.encode()) + 1
        self.num_records = len(records)
        self._open()
        # the spool is written before the id log: ids the log lacks after the last one it has were
        # cut off by a crash, and are counted now (earlier ones only left the filter's window)
        known = [i for i, record in enumerate(records) if str(record["record_id"]) in self._recent_set]
        for record in records[known[-1] + 1 if known else 0:]:
            if str(record["record_id"]) not in self._recent_set:
                self._log_id(str(record["record_id"]))
        self._flush()
        return records

    # ---- intake -----------------------------------------------------------------------------
    def add(self, record: dict[str, Any]) -> bool:
        """Store a new record (False, and nothing stored, for a recent duplicate)."""
        record_id = str(record["record_id"])
        if record_id in self._recent_set:
            self.duplicates += 1
            return False
        assert self._spool is not None, "load() first"
        line = json.dumps(record) + "\n"
        self._spool.write(line)
        self._spool.flush()  # the spool before the id: a crash between them is repaired by load()
        self.num_records += 1
        self.num_bytes += len(line.encode())
        self._log_id(record_id)
        self._flush()
        return True

    def needs_compaction(self) -> bool:
        return (self.num_bytes > self.config.max_bytes or self.num_records > 2 * max(self.keep(), 1000)
                or self._num_id_lines > 2 * self.config.dedup_window)

    def compact(self) -> None:
        """Rewrite the spool with the newest records that are still of use, and the id log with the
        filter's ids; each atomically."""
        self._close()
        keep = max(self.keep(), 0)
        with self.path.open() as handle:  # only the newest `keep` lines in memory, however long the file
            lines = list(deque((line.rstrip("\n") for line in handle if line.strip()), maxlen=keep))
        budget, kept = self.config.max_bytes // 2, 0
        for line in reversed(lines):
            if budget < len(line.encode()) + 1:
                break
            budget -= len(line.encode()) + 1
            kept += 1
        self.dropped_for_space += len(lines) - kept
        lines = lines[len(lines) - kept:]
        # ids first: every record the new spool holds must already be counted on disk
        first = self.records_in - len(self._recent) + 1
        _replace(self.ids_path, [json.dumps([first + i, record_id]) for i, record_id in enumerate(self._recent)])
        _replace(self.path, lines)
        self._num_id_lines = len(self._recent)
        self.num_records, self.num_bytes = len(lines), sum(len(line.encode()) + 1 for line in lines)
        self.compactions += 1
        self._open()

    def close(self) -> None:
        for handle in (self._spool, self._ids):
            if handle is not None:
                handle.flush()
                os.fsync(handle.fileno())
        self._close()

    # ---- internals --------------------------------------------------------------------------
    def _log_id(self, record_id: str) -> None:
        assert self._ids is not None
        self.records_in += 1
        self._ids.write(json.dumps([self.records_in, record_id]) + "\n")
        self._num_id_lines += 1
        self._remember(record_id)

    def _remember(self, record_id: str) -> None:
        if record_id in self._recent_set:
            return
        self._recent.append(record_id)
        self._recent_set.add(record_id)
        while len(self._recent) > self.config.dedup_window:
            self._recent_set.discard(self._recent.popleft())

    def _flush(self) -> None:
        for handle in (self._spool, self._ids):
            if handle is not None:
                handle.flush()

    def _open(self) -> None:
        self._spool = self.path.open("a")
        self._ids = self.ids_path.open("a")

    def _close(self) -> None:
        for handle in (self._spool, self._ids):
            if handle is not None:
                handle.close()
        self._spool = self._ids = None


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _end_cut_line(path: Path) -> None:
    """End a line that a crash cut off, so that the next append starts a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) != b"\n":
            handle.write(b"\n")


def _replace(path: Path, lines: list[str]) -> None:
    """Write `lines` to `path` atomically: a new file, fsync'd, renamed over the old one."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write("".join(line + "\n" for line in lines))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)
