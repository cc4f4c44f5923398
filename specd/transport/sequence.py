"""Per-server sequence numbers on records sent over a broker, and the gaps a learner finds in them.

Contract: a publisher stamps each record as it first leaves for the broker with `SEQUENCE_FIELD`,
{"run": the id of this publisher's run, "n": 1, 2, 3, ...} (`SequenceStamp`); a record it shed
before sending (counted there) takes no number, so it is not counted again here. A learner passes
every record it receives to `SequenceGaps.note` (refused ones too, since they arrived; not the
duplicates QoS 1 redelivers). `missing` counts, over every (server, run), the numbers between the
lowest received and the highest known that never arrived: records a broker dropped (a full queue
for an absent learner, an expired session) or lost on the way, which no other counter can see. The
highest known is the highest received or, if higher, what the run's acceptance reports say it had
sent: a publisher marks each report as it first leaves with {"run": ..., "sent": the last number it
had given} (`SequenceStamp.mark_json`), and a learner passes every report to `SequenceGaps.note_sent`,
so records lost after the last one received count too once a later report arrives (reports are
cumulative and sent every few seconds, so they come after traffic stops). A report leaves after
every record numbered before it was acknowledged by the broker, so on a broker that keeps a
session's order nothing is counted that is merely on its way; a number counted missing that still
arrives is no longer counted. Records lost before the first message this learner process
received from a run are not counted (a restarted learner cannot tell them from the ones its
predecessor received). A record without a stamp (an older server, the in-process bus, which
counts its own sheds) is not counted. With data-parallel ranks each rank receives only part of every run (the
shared subscription), so a rank's gaps are not losses: the ranks do not keep the count. At most
`MAX_RUNS` runs are kept, the most recently heard from.
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

SEQUENCE_FIELD = "sequence"
MAX_RUNS = 1000


class SequenceStamp:
    """A publisher's numbering: a fresh run id per publisher, numbers from 1 in the order records
    are stamped (thread-safe)."""

    def __init__(self) -> None:
        self.run = secrets.token_hex(6)
        self._numbers = itertools.count(1)
        self.last = 0   # the last number given
        self._lock = threading.Lock()

    def stamp_json(self, record: bytes) -> bytes:
        """The record (a JSON object, encoded) with the next number spliced in as its first field:
        a record with the target's features is megabytes, not worth decoding again to add a field."""
        with self._lock:
            number = self.last = next(self._numbers)
        return _spliced({SEQUENCE_FIELD: {"run": self.run, "n": number}}, record)

    def mark_json(self, report: bytes) -> bytes:
        """A report (an encoded JSON object) marked with the last number this run has given."""
        with self._lock:
            sent = self.last
        return _spliced({SEQUENCE_FIELD: {"run": self.run, "sent": sent}}, report)


def _spliced(field: dict[str, Any], message: bytes) -> bytes:
    """`field` spliced into the encoded JSON object `message` as its first field."""
    head = json.dumps(field).encode()
    body = message.strip()
    if not (body.startswith(b"{") and body.endswith(b"}")):
        raise ValueError("a message to number must be an encoded JSON object")
    inner = body[1:-1].strip()
    return head if not inner else head[:-1] + b", " + inner + b"}"


@dataclass
class _Run:
    lowest: int
    highest: int
    received: int = 0

    @property
    def missing(self) -> int:
        return max(0, self.highest - self.lowest + 1 - self.received)


class SequenceGaps:
    """The learner's side: per (server, run), the numbers received; `missing` the gaps between."""

    def __init__(self, max_runs: int = MAX_RUNS) -> None:
        self._runs: OrderedDict[tuple[str, str], _Run] = OrderedDict()
        self._max_runs = max_runs
        self._forgotten_missing = 0   # gaps of runs evicted from the table still count

    def note(self, record: dict[str, Any]) -> None:
        key, number = _stamp_of(record, "n")
        if key is None or number < 1:
            return  # a garbled stamp says nothing about what went missing
        entry = self._runs.get(key)
        if entry is None:
            entry = self._runs[key] = _Run(number, number)
            if len(self._runs) > self._max_runs:
                _, oldest = self._runs.popitem(last=False)
                self._forgotten_missing += oldest.missing
        self._runs.move_to_end(key)
        entry.lowest, entry.highest = min(entry.lowest, number), max(entry.highest, number)
        entry.received += 1

    def note_sent(self, report: dict[str, Any]) -> None:
        """A report's mark: the numbers its run gave up to `sent`, received or not. Only for a run
        this learner process has received a record from (see the contract)."""
        key, sent = _stamp_of(report, "sent")
        entry = self._runs.get(key) if key is not None else None
        if entry is not None and sent > entry.highest:
            entry.highest = sent

    @property
    def missing(self) -> int:
        return self._forgotten_missing + sum(run.missing for run in self._runs.values())

    def by_server(self) -> dict[str, int]:
        """Missing records per server id (only servers with a gap)."""
        totals: dict[str, int] = {}
        for (server, _), run in self._runs.items():
            if run.missing:
                totals[server] = totals.get(server, 0) + run.missing
        return totals


def _stamp_of(message: dict[str, Any], field: str) -> tuple[tuple[str, str] | None, int]:
    """((server, run), the stamp's `field`) of a message, or (None, 0) when its stamp is garbled."""
    stamp = message.get(SEQUENCE_FIELD)
    if not isinstance(stamp, dict):
        return None, 0
    run, value, server = stamp.get("run"), stamp.get(field), message.get("server_id")
    if not (isinstance(run, str) and isinstance(server, str) and isinstance(value, int)) or isinstance(value, bool):
        return None, 0
    return (server, run[:64]), value
