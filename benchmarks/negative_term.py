"""Does the negative term help? Simulated accept length per learner step, with and without it.

On the learnable tiny target (`specd.testing.learnable_target`), records are produced by the
engine with a weak drafter in the loop, so they carry real rejected drafts. Learners that differ
only in `negative_coef` train on the same records from the same initial drafter and seeds; every
`--every` steps each is scored on held-out records (teacher-forced accept length at k = 4).
Writes JSON (default out/negative_term.json) and prints the curves' means.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from specd.bus import InProcessBus
from specd.drafter.checkpoint import TargetFingerprint
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.learner.learner import Learner, LearnerConfig
from specd.learner.records import record_from_sequence, validate_record
from specd.learner.signal import simulated_accept_length
from specd.serving.engine import Engine, EngineConfig
from specd.serving.request import SamplingParams
from specd.testing import learnable_target

SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def records_with_drafts(target, drafter_model, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(target.config.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(count)]
    engine = Engine(target, TokenDrafter(drafter_model), EngineConfig(max_batch=8, num_draft_tokens=4))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=24))
    return [record_from_sequence(s, "bench", 0.0).to_dict() for s in seqs]


def curve(coef: float, seed: int, train: list[dict], held_out, steps: int, every: int, initial) -> list[float]:
    torch.manual_seed(seed)
    bus = InProcessBus()
    config = LearnerConfig(learning_rate=3e-3, batch_size=16, window=32, duty_cycle=1.0, negative_coef=coef,
                           publish_every_steps=10**9, publish_every_seconds=10**9, holdout_every=10**9,
                           prompt_weight=0.0, seed=seed)
    learner = Learner(config, bus, WeightStore(tempfile.mkdtemp()), initial,
                      TargetFingerprint(initial.config.vocab_size, "none"))
    for record in train:
        bus.publish(record)
    scores = []
    for step in range(1, steps + 1):
        learner.step()
        if step % every == 0:
            scores.append(simulated_accept_length(learner.model, held_out, k=4))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coefs", nargs="+", type=float, default=[0.0, 0.25, 1.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default="out/negative_term.json")
    args = parser.parse_args()
    target = learnable_target()
    initial = new_drafter_model(target, SHAPE, copy_from_target=False, seed=0).float()
    train = records_with_drafts(target, initial, 64, seed=1)
    held_out = [validate_record(r, target.config.vocab_size) for r in records_with_drafts(target, initial, 16, seed=99)]
    results = {}
    for coef in args.coefs:
        curves = [curve(coef, seed, train, held_out, args.steps, args.every, initial) for seed in range(args.seeds)]
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
        results[str(coef)] = {"mean_accept_length": mean, "curves": curves}
        print(f"negative_coef={coef:<5} accept length every {args.every} steps: "
              + " ".join(f"{v:.2f}" for v in mean), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "every": args.every, "results": results}, indent=2))


if __name__ == "__main__":
    main()
