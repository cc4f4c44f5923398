"""What online learning does to the domain the drafter was pretrained on: chats first, then code.

Contract: the service's own `Learner` (`LearnerConfig`'s defaults: float32, no anchor), started from
the shipped pretrained drafter, is fed `--records` ShareGPT chats and then as many HumanEval
problems, `--per-round` at a time with a number of steps after each, all drawn from the validation
items of `demo_learner_sweep.py` (none the demo serves, none pretraining saw: chats from the
benchmark pool, problems outside the demo's); as many more of each are held out. SmolLM2 answers
them greedily with no drafter. Each arm names its optimiser and settings (`--arms`, comma-separated
`optimiser:learning_rate[:steps_per_round]`; optimisers "adamw" (the learner's), "adamw95"
(AdamW with beta2 0.95, as pretraining) and "sgd" (momentum 0.9)). Reported per arm: the held-out
accept length of each domain (greedy, k = 4, exact replay) at day 0, after the chats and after the
code. Writes JSON (default out/in_domain_learning.json) and prints a markdown table.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from typing import Any

import torch
from common import markdown_table, parser, write_result
from demo_learner_sweep import feed_round, held_out_accept_lengths, make_records, sweep_learner, validation_items

from specd.core.records import TrajectoryRecord
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.model.target import LoadedTarget

K = 4
OPTIMISERS = ("adamw", "adamw95", "sgd")


def use_optimiser(learner: Learner, name: str, learning_rate: float) -> None:
    params = [p for p in learner.model.parameters() if p.requires_grad]  # what the trainer's optimiser steps
    if name == "adamw95":
        learner.trainer.optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    elif name == "sgd":
        learner.trainer.optimizer = torch.optim.SGD(params, lr=learning_rate, momentum=0.9)


def run_arm(loaded: LoadedTarget, arm: str, phases: dict[str, list[TrajectoryRecord]],
            held_out: dict[str, list[TrajectoryRecord]], per_round: int) -> dict[str, Any]:
    name, rate, *rest = arm.split(":")
    if name not in OPTIMISERS:
        raise SystemExit(f"unknown optimiser {name!r} in arm {arm!r}: one of {', '.join(OPTIMISERS)}")
    learning_rate, steps = float(rate), int(rest[0]) if rest else 10
    config = replace(LearnerConfig(), feature_learning_rate=learning_rate, seed=0)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="in-domain-") as tmp:
        learner = sweep_learner(loaded, config, tmp)
        use_optimiser(learner, name, learning_rate)
        points = {"day 0": held_out_accept_lengths(learner, held_out)}
        for phase, records in phases.items():
            for start in range(0, len(records), per_round):
                feed_round(learner, records[start:start + per_round], steps)
            points[f"after {phase}"] = held_out_accept_lengths(learner, held_out)
            print(f"  {arm}: after {phase} " + ", ".join(f"{d} {v:.3f}" for d, v in points[f'after {phase}'].items()),
                  flush=True)
    return {"arm": arm, "optimiser": name, "learning_rate": learning_rate, "steps_per_round": steps,
            "points": points, "seconds": round(time.time() - started, 1)}


def main() -> None:
    p = parser(__doc__, "out/in_domain_learning.json", 1)
    p.add_argument("--arms", default="adamw:5e-5,adamw:5e-5:2,adamw:1.5e-5,sgd:0.01")
    p.add_argument("--records", type=int, default=20, help="training records of each domain")
    p.add_argument("--held-out", type=int, default=16, help="held-out records of each domain")
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = LoadedTarget.load()
    chat = make_records(loaded, validation_items(args.records + args.held_out, "sharegpt"), args.max_tokens)
    code = make_records(loaded, validation_items(args.records + args.held_out), args.max_tokens)
    phases = {"chat": chat[:args.records], "code": code[:args.records]}
    held_out = {"chat": chat[args.records:], "code": code[args.records:]}
    arms = [run_arm(loaded, arm, phases, held_out, args.per_round) for arm in args.arms.split(",")]
    rows = [[a["arm"], *(f"{a['points'][point][domain]:.3f}" for point in a["points"] for domain in held_out)]
            for a in arms]
    print(markdown_table(["arm", *(f"{domain} {point}" for point in arms[0]["points"] for domain in held_out)], rows))
    write_result(args.out, args, {"k": K, "held_out": {d: len(r) for d, r in held_out.items()},
                                  "records": {d: len(r) for d, r in phases.items()}, "per_round": args.per_round,
                                  "max_tokens": args.max_tokens, "arms": arms})


if __name__ == "__main__":
    main()
