"""Where a learner's memory goes: its resident size broken down by part, each part bounded by a setting.

Contract: `memory_breakdown(learner, backlog_records)` returns bytes per part, measured from the objects
themselves (tensor and array sizes, token lists at 36 bytes a token: an 8-byte list slot and a
28-byte int), beside the process's resident set (`rss`, from /proc) and what those parts do not
explain (`other`: the interpreter, the target's weights, allocator slack). The parts and their
bounds:
- `buffer`: training records (`feature_buffer_capacity` / `buffer_capacity` records),
- `held_out`: the gate's records (`holdout_capacity`),
- `feature_cache`: recomputed features of id-only records (records held, buffer plus held out);
  features a record carries are read in place, not copied,
- `canary_waiting`: records waiting for the canary (64),
- `models`: the training copy, its optimiser state, the gate's live and bar copies and the canary's two;
beside them `backlog_records`, how many records wait on the bus (its capacity bounds it).
Where the objective has no feature cache (the token drafter's), that part is 0.
The spool is on disk (SQLite; its page cache is SQLite's default, about 2 MB).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from specd.core.records import TrajectoryRecord

TOKEN_BYTES = 36


def record_bytes(record: TrajectoryRecord) -> int:
    features = len(record.features.data) if record.features is not None else 0
    return record.num_tokens * TOKEN_BYTES + features


def records_bytes(records: Iterable[TrajectoryRecord]) -> int:
    return sum(record_bytes(r) for r in list(records))


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_bytes(model: torch.nn.Module | None) -> int:
    return 0 if model is None else tensors_bytes(p for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    states = list(optimizer.state.values())  # a copy: the learner thread may add to it meanwhile
    return tensors_bytes(v for state in states for v in state.values() if torch.is_tensor(v))


def resident_bytes() -> int | None:
    """This process's resident set size, None where /proc is not there."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_breakdown(learner: Any, backlog_records: int = 0) -> dict[str, int | None]:
    """Bytes per part of a `specd.learner.learner.Learner` (see the module docstring)."""
    objective = learner.objective
    canary = learner.canary
    models = (model_bytes(learner.model) + optimizer_bytes(learner.optimizer)
              + sum(model_bytes(m) for m in learner.promoter.gate_copies)
              + (sum(model_bytes(m) for m in list(canary.models.values())) if canary is not None else 0))
    parts: dict[str, int | None] = {
        "buffer": records_bytes(learner.buffer),
        "held_out": records_bytes(learner.holdout),
        "feature_cache": getattr(objective, "cache_bytes", 0),
        "canary_waiting": records_bytes(canary.waiting) if canary is not None else 0,
        "models": models,
    }
    rss = resident_bytes()
    explained = sum(v for v in parts.values() if v is not None)
    return {**parts, "rss": rss, "other": rss - explained if rss is not None else None,
            "backlog_records": backlog_records}
