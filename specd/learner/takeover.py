"""Records left behind on a store by learners that will not run again: taken over, not stranded.

A store's learner changes shape: `--ranks 3` becomes `--ranks 2`, ranks become one plain learner,
or the other way round. Each learner that ran left a spool folder (the store itself for a plain
learner, `rank-N/` for rank N) and an MQTT session that the broker keeps queuing records for
(persistent: a rank's never expires). Nobody would read either again, so the learner that starts
now (a plain one, or rank 0 of a group) takes them over.

Contract:
- `mark_session(folder, client_id, share_group)` records in a spool folder which MQTT session its
  learner used (`session.json`), so a successor ends the right one; a folder without it (an older
  specd) is read as the default naming (`<client id>` for the store, `<client id>-rankN` for
  `rank-N/`, in the shared group `<client id>`).
- `left_behind(store, world_size)` lists the spool folders of learners that will not run: every
  `rank-N/` for a plain learner (`world_size` None), the store's own spool and every `rank-N/`
  with N >= `world_size` for a group.
- `LeftBehind.take(folder, client_id)` claims the folder (StoreError naming the pid if a process
  still runs there: a leftover rank) and returns its spool's records (those still of use), its
  rank's status file removed; the spool's database is deleted once read (its records are in the
  successor's spool by then: `take` is called before anything else adds to it).
- `LeftBehind.end_sessions(handle)` then, with the broker up, takes what each session still had
  queued through `handle` and ends the session (`transport.retirement.retire_session`), and only then
  removes the folder's marker and lock; a broker that cannot be reached leaves the folder to the
  next start (its records were taken already, and the spool's duplicate filter drops them if seen
  again).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.core.files import write_text_atomic
from specd.learner.claim import LearnerClaim, claim
from specd.learner.ranks import status_path
from specd.learner.spool import DATABASE, SPOOL_INDEX, RecordSpool, SpoolConfig
from specd.transport.mqtt import MqttSettings
from specd.transport.retirement import retire_session

log = logging.getLogger(__name__)

SESSION_FILE = "session.json"
SPOOL_FILES = (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm")   # SQLite's database and its WAL files
_RANK_FOLDER = re.compile(r"rank-(\d+)")


def session_of(client_id: str, rank: int | None) -> tuple[str, str | None]:
    """(MQTT client id, shared group) of a plain learner's session (`rank` None) or rank `rank`'s."""
    return (client_id, None) if rank is None else (f"{client_id}-rank{rank}", client_id)


def mark_session(folder: str | Path, client_id: str, share_group: str | None) -> None:
    write_text_atomic(Path(folder) / SESSION_FILE, json.dumps({"client_id": client_id, "share_group": share_group}))


def _rank_of(folder: Path) -> int | None:
    matched = _RANK_FOLDER.fullmatch(folder.name)
    return int(matched.group(1)) if matched else None


def left_behind(store: str | Path, world_size: int | None) -> list[Path]:
    """Spool folders of learners that will not run on `store` again (see the module's contract)."""
    store = Path(store)
    ranks = sorted((rank, path) for path in store.glob("rank-*") if path.is_dir()
                   for rank in [_rank_of(path)] if rank is not None)
    if world_size is None:
        return [path for _, path in ranks]
    own_spool_left = any((store / name).exists() for name in (*SPOOL_FILES, SESSION_FILE))
    return ([store] if own_spool_left else []) + [path for rank, path in ranks if rank >= world_size]


def _session_of(folder: Path, store: Path, client_id: str) -> tuple[str, str | None]:
    """(client id, shared group) of the session the folder's learner used."""
    try:
        marked = json.loads((folder / SESSION_FILE).read_text())
        return str(marked["client_id"]), marked.get("share_group")
    except (OSError, ValueError, KeyError, TypeError):
        return session_of(client_id, None if folder == store else _rank_of(folder))


@dataclass
class LeftBehind:
    store: Path
    spool: SpoolConfig
    keep: Callable[[], int]
    taken: list[tuple[Path, LearnerClaim | None, str, str | None]] = field(default_factory=list)

    def take(self, folder: Path, client_id: str, store_claim: LearnerClaim | None) -> Iterator[dict[str, Any]]:
        """The records of `folder`'s spool (numbers stripped: the successor numbers them anew)."""
        held = store_claim if folder == self.store else claim(
            folder, "stop it (a leftover learner rank), then start this learner again", per="spool folder")
        session = _session_of(folder, self.store, client_id)
        self.taken.append((folder, held, *session))
        rank = _rank_of(folder)
        if rank is not None:
            status_path(self.store, rank).unlink(missing_ok=True)
        if not (folder / DATABASE).exists():
            return
        spool = RecordSpool(folder, self.spool, self.keep)
        count = 0
        try:
            for record in spool.load():
                count += 1
                yield {key: value for key, value in record.items() if key != SPOOL_INDEX}
        finally:
            spool.close()
        for name in SPOOL_FILES:
            (folder / name).unlink(missing_ok=True)
        log.warning("took over %d records from %s, the spool of a learner that no longer runs on this store",
                    count, folder)

    async def end_sessions(self, settings: MqttSettings, handle: Callable[[str, bytes], Awaitable[None]]) -> None:
        """Take what the left-behind sessions hold at the broker and end them (see the contract)."""
        for folder, held, client_id, share_group in list(self.taken):
            try:
                taken = await retire_session(settings, client_id, share_group, handle)
            except Exception as error:  # the broker is down: the next start tries again
                log.warning("could not end the MQTT session %s of a learner that no longer runs (%s); "
                            "the next start tries again", client_id, error)
                continue
            if taken:
                log.warning("took %d messages (records and acceptance reports) the broker still held for %s",
                            taken, client_id)
            (folder / SESSION_FILE).unlink(missing_ok=True)
            if folder != self.store:
                if held is not None:
                    held.release()
                shutil.rmtree(folder, ignore_errors=True)
            self.taken.remove((folder, held, client_id, share_group))

    def release(self) -> None:
        """Give up the folders still held (their sessions not ended: the next start takes them again)."""
        for folder, held, _, _ in self.taken:
            if held is not None and folder != self.store:
                held.release()
