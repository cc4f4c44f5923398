"""Does the negative term help? Simulated accept length per learner step, with and without it.

On SmolLM2 (default) or the learnable tiny target (`--tiny`), records are produced by the
engine with the untrained drafter in the loop, so they carry real rejected drafts (ShareGPT then
HumanEval prompts on SmolLM2). Learners that differ only in `negative_coef` train on the same
records from the same initial drafter and seeds; every `--every` steps each is scored on
held-out records (teacher-forced accept length at k = 4).
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
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.learner import Learner, LearnerConfig
from specd.learner.signal import simulated_accept_length
from specd.model.fingerprint import TargetFingerprint
from specd.records import validate_record
from specd.testing import learnable_target

SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def records_with_drafts(target, drafter_model, prompts: list[list[int]], max_tokens: int,
                        eos: tuple[int, ...] = ()) -> list[dict]:
    engine = Engine(target, TokenDrafter(drafter_model), EngineConfig(
        max_batch=8, num_draft_tokens=4, adaptive_lookahead=False, eos_token_ids=eos))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [record_from_sequence(s, "bench", 0.0).to_dict() for s in seqs]


def tiny_setup():
    target = learnable_target()
    initial = new_drafter_model(target, SHAPE, copy_from_target=False, seed=0).float()
    rng = random.Random(0)
    prompts = [[rng.randrange(target.config.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(80)]
    records = records_with_drafts(target, initial, prompts, 24)
    return target, initial, records[:64], records[64:], TargetFingerprint(target.config.vocab_size, "none"), 32


def smollm2_setup(requests: int):
    from specd.demo import encode
    from specd.model.target import LoadedTarget
    from specd.traffic import default_shift_traffic

    loaded = LoadedTarget.load(None)
    initial = new_drafter_model(loaded.model, DrafterShape.like(loaded.model.config, 1, 8192), seed=0)
    items = default_shift_traffic(requests)
    prompts = [encode(loaded, item) for item in items]
    records = records_with_drafts(loaded.model, initial, prompts, 64, loaded.eos_token_ids)
    held_out = records[3::4]
    train = [r for i, r in enumerate(records) if i % 4 != 3]
    return loaded.model, initial, train, held_out, loaded.fingerprint, 96


def curve(coef: float, seed: int, train: list[dict], held_out, steps: int, every: int, initial,
          fingerprint: TargetFingerprint, window: int) -> list[float]:
    torch.manual_seed(seed)
    bus = InProcessBus()
    config = LearnerConfig(batch_size=8, window=window, duty_cycle=1.0, negative_coef=coef,
                           publish_every_steps=10**9, publish_every_seconds=10**9, holdout_every=10**9, seed=seed)
    learner = Learner(config, bus, WeightStore(tempfile.mkdtemp()), initial, fingerprint)
    for record in train:
        bus.publish(record)
    scores = []
    for step in range(1, steps + 1):
        learner.step()
        if step % every == 0:
            scores.append(simulated_accept_length(learner.model.eval(), held_out, k=4))
            learner.model.train()
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coefs", nargs="+", type=float, default=[0.0, 0.3, 1.0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--requests", type=int, default=48, help="SmolLM2 requests to record (default 48)")
    parser.add_argument("--tiny", action="store_true", help="use the learnable tiny target instead of SmolLM2")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default="out/negative_term.json")
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    target, initial, train, held_raw, fingerprint, window = tiny_setup() if args.tiny else smollm2_setup(args.requests)
    held_out = [validate_record(r, target.config.vocab_size) for r in held_raw]
    rejected = sum(len(s["drafts"]) > s["num_accepted"] for r in train for s in r["steps"])
    print(f"{len(train)} training records with {rejected} rejected drafts; {len(held_out)} held out", flush=True)
    results = {}
    for coef in args.coefs:
        curves = [curve(coef, seed, train, held_out, args.steps, args.every, initial, fingerprint, window)
                  for seed in range(args.seeds)]
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
        results[str(coef)] = {"mean_accept_length": mean, "curves": curves}
        print(f"negative_coef={coef:<5} accept length every {args.every} steps: "
              + " ".join(f"{v:.2f}" for v in mean), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"target": "tiny" if args.tiny else "smollm2", "steps": args.steps,
                                          "every": args.every, "results": results}, indent=2))


if __name__ == "__main__":
    main()
