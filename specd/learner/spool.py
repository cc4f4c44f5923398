"""The learner sidecar's record spool: what a restarted learner reloads, bounded on disk, in SQLite.

Contract:
- One SQLite database, `spool.sqlite3` in `folder`, in WAL mode. Table `records` holds each stored
  record (its number n the primary key, its id unique, its JSON, its size); table `seen` holds the newest
  `dedup_window` record ids with their number n, counting every new record ever received, which
  keeps the duplicate filter and `records_in` across restarts and across pruning.
- `add(record)` stores a record that has a `record_id` unless that id is among the most recent
  `dedup_window` ids (QoS 1 redelivers recent messages only), and returns whether it was new.
  The id and the record go in one transaction, committed before `add` returns: a process killed
  at any point leaves both or neither (crash safety by design, no repair at start); with
  `synchronous=NORMAL` a machine that loses power may lose the last commits, never a mix.
- Bounded: `compact()` (due when `needs_compaction()`) deletes the oldest records past the newest
  `keep()` (what the learner's bounded buffers and the bus can still use) and past half of
  `max_bytes` of record JSON, and the ids past the window. SQLite reuses the freed pages, so the
  file stays near the bound.
- `load()` (once, at start) restores the count and yields the stored records oldest first, read
  from the database in pages: the spool is never held whole in memory. Each carries its number n
  under `SPOOL_INDEX` (the sidecar sends new ones with it too): the learner holds a record out for
  its gate by that number, so a record keeps its role (held out or trained on) across restarts
  and compaction.
- A folder that still holds the JSONL spool of earlier versions (`received.jsonl`,
  `received-ids.jsonl`) is imported once at the first `load()`, then those files are renamed
  with a `.imported` suffix.
Single writer: one task calls `add` and `compact` (possibly on another thread, never at once);
the counters may be read from anywhere.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.core.errors import SpecdError, out_of_space

log = logging.getLogger(__name__)


class SpoolFull(SpecdError):
    """The spool's disk is full: the record was not stored (and must not be acknowledged)."""

    kind = "spool_full"
    http_status = 507

DATABASE = "spool.sqlite3"
SPOOL_INDEX = "_spool_index"  # a record's number n, beside its fields on the learner's bus
PAGE = 256  # records read per query at load
SCHEMA = """
CREATE TABLE IF NOT EXISTS records (n INTEGER PRIMARY KEY, record_id TEXT NOT NULL UNIQUE,
                                    body TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS seen (n INTEGER PRIMARY KEY, record_id TEXT NOT NULL UNIQUE);
"""


@dataclass(frozen=True)
class SpoolConfig:
    max_bytes: int = 1 << 30         # the records' bound on disk (feature records are ~5 KB a token)
    dedup_window: int = 200_000      # recent record ids kept to drop QoS 1 redeliveries

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.dedup_window < 1:
            raise ValueError(f"spool bounds must be positive, got {self}")


class RecordSpool:
    def __init__(self, folder: str | Path, config: SpoolConfig, keep: Callable[[], int]) -> None:
        self.folder = Path(folder)
        self.config = config
        self.keep = keep                              # records the learner can still use, asked at compaction
        self.path = self.folder / DATABASE
        self.records_in = 0                           # unique records ever received, across restarts
        self.duplicates = 0                           # redeliveries dropped since start
        self.compactions = 0
        self.dropped_for_space = 0                    # records compaction wanted to keep but max_bytes did not fit
        self.num_records = 0                          # records stored
        self.num_bytes = 0                            # their JSON's size
        self.num_ids = 0                              # ids in the duplicate filter
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()                 # add and compact may run on two threads, never at once

    # ---- start ------------------------------------------------------------------------------
    def load(self) -> Iterator[dict[str, Any]]:
        """Open (or create) the database and restore the counts; then yield the stored records,
        oldest first, a page at a time, each with its place in the spool under `SPOOL_INDEX`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        self._db = db
        _import_jsonl(self.folder, db)
        self._count()
        return self._stored()

    def _stored(self) -> Iterator[dict[str, Any]]:
        last = 0
        while True:
            with self._lock:
                rows = self._conn.execute("SELECT n, body FROM records WHERE n > ? ORDER BY n LIMIT ?",
                                          (last, PAGE)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            for n, body in rows:
                yield {**json.loads(body), SPOOL_INDEX: n}

    def _count(self) -> None:
        db = self._conn
        self.records_in = int(db.execute("SELECT COALESCE(MAX(n), 0) FROM seen").fetchone()[0])
        stored = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM records").fetchone()
        self.num_records, self.num_bytes = int(stored[0]), int(stored[1])
        self.num_ids = int(db.execute("SELECT COUNT(*) FROM seen").fetchone()[0])

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the spool is not open: load() first")
        return self._db

    # ---- intake -----------------------------------------------------------------------------
    def add(self, record: dict[str, Any]) -> bool:
        """Store a new record (False, and nothing stored, for a recent duplicate)."""
        record_id = str(record["record_id"])
        body = json.dumps(record)
        with self._lock:
            db = self._conn
            db.execute("BEGIN IMMEDIATE")
            try:
                taken = db.execute("INSERT OR IGNORE INTO seen (n, record_id) VALUES (?, ?)",
                                   (self.records_in + 1, record_id)).rowcount
                replaced = None
                if taken:  # an id that left the window may still be stored: the new copy replaces it
                    replaced = db.execute("DELETE FROM records WHERE record_id = ? RETURNING bytes",
                                          (record_id,)).fetchone()
                    db.execute("INSERT INTO records (n, record_id, body, bytes) VALUES (?, ?, ?, ?)",
                               (self.records_in + 1, record_id, body, len(body)))
                db.execute("COMMIT")
            except BaseException as error:
                if db.in_transaction:  # a failed COMMIT (a full disk) may have ended it already
                    db.execute("ROLLBACK")
                if isinstance(error, sqlite3.OperationalError) and out_of_space(error):
                    raise SpoolFull(f"the spool {self.path} cannot store a record: {error} (the record stays "
                                    f"with the broker, unacknowledged, and comes again once there is room)") from error
                raise
        if not taken:
            self.duplicates += 1
            return False
        self.records_in += 1
        self.num_records += 1 if replaced is None else 0
        self.num_bytes += len(body) - (replaced[0] if replaced is not None else 0)
        self.num_ids += 1
        return True

    def needs_compaction(self) -> bool:
        return (self.num_bytes > self.config.max_bytes or self.num_records > 2 * max(self.keep(), 1000)
                or self.num_ids > 2 * self.config.dedup_window)

    def compact(self) -> None:
        """Delete the records no longer of use (past `keep()`, past half of `max_bytes`, oldest
        first) and the ids past the duplicate window, in one transaction."""
        keep = max(self.keep(), 0)
        with self._lock:
            db = self._conn
            db.execute("BEGIN IMMEDIATE")
            try:
                wanted = db.execute("SELECT n, bytes FROM records ORDER BY n DESC LIMIT ?", (keep,)).fetchall()
                budget, first_kept = self.config.max_bytes // 2, None
                for n, size in wanted:
                    if budget < size:
                        break
                    budget -= size
                    first_kept = n
                kept = sum(1 for n, _ in wanted if first_kept is not None and n >= first_kept)
                self.dropped_for_space += len(wanted) - kept
                db.execute("DELETE FROM records WHERE n < ?", (first_kept if first_kept is not None else 1 << 62,))
                db.execute("DELETE FROM seen WHERE n <= ?", (self.records_in - self.config.dedup_window,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._count()
        self.compactions += 1

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _import_jsonl(folder: Path, db: sqlite3.Connection) -> None:
    """Move an earlier version's JSONL spool into the database, once (ids first, then records)."""
    spool, ids = folder / "received.jsonl", folder / "received-ids.jsonl"
    if not spool.is_file() and not ids.is_file():
        return
    db.execute("BEGIN IMMEDIATE")
    numbers: dict[str, int] = {}
    for line in _lines(ids):
        try:
            number, record_id = json.loads(line)
            numbers[str(record_id)] = int(number)
        except (ValueError, TypeError):
            continue  # a line cut by a crash mid-write
    last = max(numbers.values(), default=0)
    imported = 0
    for line in _lines(spool):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("record_id") is None:
            continue
        record_id = str(record["record_id"])
        if record_id not in numbers:  # its id line was cut off by a crash: it is counted now
            last += 1
            numbers[record_id] = last
        body = json.dumps(record)
        db.execute("INSERT OR IGNORE INTO records (n, record_id, body, bytes) VALUES (?, ?, ?, ?)",
                   (numbers[record_id], record_id, body, len(body)))
        imported += 1
    db.executemany("INSERT OR IGNORE INTO seen (n, record_id) VALUES (?, ?)",
                   [(n, record_id) for record_id, n in numbers.items()])
    db.execute("COMMIT")
    for path in (spool, ids):
        if path.is_file():
            path.rename(path.with_name(path.name + ".imported"))
    log.info("imported %d records and %d ids from the JSONL spool in %s", imported, len(numbers), folder)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []
