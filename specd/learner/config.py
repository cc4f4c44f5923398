"""The learner's settings and counters.

Contract: `LearnerConfig` is validated on construction (a setting that cannot work raises
`ConfigurationError` before a learner starts); `LearnerStats` holds the counters every part of the
learner updates (intake, trainer, promotion, loop) and that servers, metrics and the learner
process report. The feature drafter's own settings carry the `feature_` prefix (see
`specd.learner.trainer.TRAINING`, which picks them per drafter architecture).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from specd.core.errors import ConfigurationError


@dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float = 2e-3
    batch_size: int = 8
    window: int = 96
    negative_coef: float = 0.0       # chosen by benchmarks/negative_term.py; see docs/history.md
    miss_weight: float = 2.0
    prompt_weight: float = 0.1
    buffer_capacity: int = 2000
    feature_learning_rate: float = 5e-5  # the feature drafter starts trained: larger steps undo it (learning_curve.py)
    feature_buffer_capacity: int = 400   # feature records are large (~4.6 KB a token for SmolLM2)
    feature_window: int = 256
    feature_prompt_weight: float = 0.5  # prompt positions carry the target's real features and labels too
    unroll: int = 3                      # drafting steps trained per position (feature drafter)
    # after every step each weight moves this share of the way back to the version training started
    # from (or last adopted): a few dozen records then bend the drafter without wearing away what
    # pretraining taught it (0: off)
    anchor_pull: float = 0.0
    # where the pull points: "start" (the weights training started from or last adopted: it bounds
    # how far the learner can ever move, about the learning rate over the pull per weight) or "live"
    # (also each version of its own that goes live: each version is a bounded step from the one
    # serving, and the drafter moves on through versions the gate passed)
    anchor: str = "live"
    # half of every batch comes from the newest records, so that a shift in traffic is learned
    # within steps, not after the buffer has turned over (the rest keeps older knowledge)
    recent_share: float = 0.5
    recent_records: int = 32
    holdout_every: int = 8
    holdout_capacity: int = 16
    publish_every_steps: int = 10
    publish_every_seconds: float = 15.0
    gate_margin: float = 0.05       # a candidate may trail the live version by this much accept length
                                    # (in proportion below accept length 1.5: `Gate.margin_below`)
    gate_min_held_out: int = 4      # below this many held-out records the gate waits: no evidence, no pass
    # > 0: the gate weighs each domain's held-out records by its share of the newest this many records
    # (`specd.learner.gate`), so that after a shift a candidate is judged on the traffic it will serve;
    # 0 weighs every held-out record alike. After a shift from chat to code (benchmarks/gate_evidence.py,
    # gate_evidence_window.json) 8 passed the first version trained on code 8 records earlier than 0
    # and 5 versions against 3, none worse than the version it replaced; records with no domain form
    # one group, as with 0
    gate_traffic_window: int = 8
    # > 0: a candidate passes only when its paired advantage over the reference on the held-out
    # records, less this many standard errors, is above -gate_margin (`specd.learner.gate`); 0 judges
    # the pooled accept lengths alone
    gate_confidence_z: float = 0.0
    hold_after_rollback_s: float = 60.0  # after someone else changes the live version, publish nothing this long
    # the canary (`specd.learner.shadow`): the live version against its predecessor, replayed on the
    # same records (every `canary_every`-th), per domain; a rollback needs `canary_min_records`
    # pairs, a mean shortfall beyond `canary_margin` accept length and `canary_z` standard errors
    canary: bool = True
    canary_every: int = 2
    canary_min_records: int = 8
    canary_margin: float = 0.05
    canary_z: float = 2.33
    k: int = 4
    min_records: int = 2
    duty_cycle: float = 0.5
    train_embeddings: bool = False   # the target's embeddings are a good, frozen start
    # training matmuls under bf16 autocast: about twice float32's steps per second where the CPU
    # has bf16 units (AMX); the gate always replays in float32, as the drafter serves
    precision: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_steps()
        if not 0 < self.duty_cycle <= 1:
            raise ConfigurationError(f"duty_cycle must be in (0, 1], got {self.duty_cycle}")
        if self.batch_size < 1 or self.window < 2:
            raise ConfigurationError("batch_size must be at least 1 and window at least 2")
        if not 0 <= self.anchor_pull < 1:
            raise ConfigurationError(f"anchor_pull must be in [0, 1), got {self.anchor_pull}")
        if self.anchor not in ("start", "live"):
            raise ConfigurationError(f"anchor must be start or live, got {self.anchor!r}")
        if self.holdout_every < 1:
            raise ConfigurationError(f"holdout_every must be at least 1, got {self.holdout_every}")
        if self.precision not in ("float32", "bfloat16"):
            raise ConfigurationError(f"precision must be float32 or bfloat16, got {self.precision!r}")
        if not 0 <= self.gate_confidence_z < math.inf:
            raise ConfigurationError(f"gate_confidence_z must be 0 (off) or a positive number of standard errors, "
                                     f"got {self.gate_confidence_z}")
        if self.gate_traffic_window < 0:
            raise ConfigurationError(f"gate_traffic_window must be 0 (off) or positive, got {self.gate_traffic_window}")
        if self.gate_min_held_out < 1:
            raise ConfigurationError(f"gate_min_held_out must be at least 1 (the gate never passes a candidate "
                                     f"without held-out evidence), got {self.gate_min_held_out}")
        if self.canary_every < 1 or self.canary_min_records < 2:
            raise ConfigurationError(f"canary_every must be at least 1 and canary_min_records at least 2, "
                                     f"got {self.canary_every} and {self.canary_min_records}")
        if self.holdout_capacity < self.gate_min_held_out:
            raise ConfigurationError(f"holdout_capacity ({self.holdout_capacity}) must be at least gate_min_held_out "
                                     f"({self.gate_min_held_out}), or no candidate could ever pass the gate")

    def _check_steps(self) -> None:
        """The step sizes, shares, counts and margins: in range, or a learner that cannot work."""
        for name, rate in {"learning_rate": self.learning_rate,
                           "feature_learning_rate": self.feature_learning_rate}.items():
            if not 0 < rate < math.inf:
                raise ConfigurationError(f"{name} must be a positive number, got {rate}")
        if not self.publish_every_seconds > 0:  # math.inf: never by time
            raise ConfigurationError(f"publish_every_seconds must be positive, got {self.publish_every_seconds}")
        counts = {"buffer_capacity": self.buffer_capacity, "feature_buffer_capacity": self.feature_buffer_capacity,
                  "publish_every_steps": self.publish_every_steps, "unroll": self.unroll}
        for name, count in counts.items():
            if count < 1:
                raise ConfigurationError(f"{name} must be at least 1, got {count}")
        if not 0 <= self.recent_share <= 1:
            raise ConfigurationError(f"recent_share must be in [0, 1], got {self.recent_share}")
        margins = {"gate_margin": self.gate_margin, "canary_margin": self.canary_margin, "canary_z": self.canary_z}
        for name, value in margins.items():
            if not 0 <= value < math.inf:
                raise ConfigurationError(f"{name} must be 0 or a positive number, got {value}")


@dataclass
class LearnerStats:
    records_in: int = 0
    refused: Counter = field(default_factory=Counter)
    steps: int = 0
    tokens_trained: int = 0
    records_trained: int = 0
    losses: deque = field(default_factory=lambda: deque(maxlen=100))
    published: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    training_seconds: float = 0.0
    gate_waits: int = 0              # publications due but skipped: too few held-out records
    loop_failures: int = 0           # steps of the learner thread that raised
    skipped_steps: int = 0           # training steps skipped for a non-finite loss or gradient
    last_failure: dict[str, Any] | None = None  # {"error": "Type: message", "time": unix seconds}
