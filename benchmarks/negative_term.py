"""Does the negative term help? Simulated accept length per learner step, with and without it, over seeds.

On SmolLM2 (default) or the learnable tiny target (`--tiny`), records are produced by the
engine with the untrained drafter in the loop, so they carry real rejected drafts (ShareGPT then
HumanEval prompts on SmolLM2). Learners that differ only in `negative_coef` train on the same
records from the same initial drafter and seeds; every `--every` steps each is scored on
held-out records (teacher-forced accept length at k = 4).
Seeds are the repeats: for each seed every coefficient trains once; each checkpoint is reported
as the median (min–max) over seeds, with the per-seed gain of each coefficient over the first one
(0) at the last checkpoint. The figure is a simulation (no timing), so the machine's noise does
not enter it; the seeds' spread does. Writes JSON (default out/negative_term.json, plot
negative_term.png) with every curve and the provenance.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import cell, dot_plot, markdown_table, parser, spread, write_result

from specd.core.records import validate_record
from specd.drafter.factory import DrafterSpec, initial_model
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.signal import simulated_accept_length
from specd.model.fingerprint import TargetFingerprint
from specd.testing import learnable_target
from specd.transport.bus import InProcessBus

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
    from specd.core.traffic import default_shift_traffic
    from specd.demo.deployment import encode
    from specd.model.target import LoadedTarget

    loaded = LoadedTarget.load(None)
    initial = initial_model(loaded.model, DrafterSpec(), seed=0)  # the day-0 drafter servers start from
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
    p = parser(__doc__, "out/negative_term.json", repeats=2)
    p.add_argument("--coefs", nargs="+", type=float, default=[0.0, 0.3, 1.0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--requests", type=int, default=48, help="SmolLM2 requests to record (default 48)")
    p.add_argument("--tiny", action="store_true", help="use the learnable tiny target instead of SmolLM2")
    p.add_argument("--every", type=int, default=20)
    args = p.parse_args()
    torch.set_grad_enabled(True)
    target, initial, train, held_raw, fingerprint, window = tiny_setup() if args.tiny else smollm2_setup(args.requests)
    held_out = [validate_record(r, target.config.vocab_size) for r in held_raw]
    rejected = sum(len(s["drafts"]) > s["num_accepted"] for r in train for s in r["steps"])
    print(f"{len(train)} training records with {rejected} rejected drafts; {len(held_out)} held out", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {str(coef): [] for coef in args.coefs}
    for seed in range(args.repeats):  # seed by seed, every coefficient
        for coef in args.coefs:
            runs[str(coef)].append({"round": seed, "curve": curve(coef, seed, train, held_out, args.steps, args.every,
                                                                  initial, fingerprint, window)})
            print(f"  seed {seed} negative_coef={coef}: " + " ".join(f"{v:.2f}" for v in runs[str(coef)][-1]["curve"]),
                  flush=True)
    base = str(args.coefs[0])
    results = {name: {"curves": [r["curve"] for r in rs],
                      "checkpoints": [spread([r["curve"][i] for r in rs]) for i in range(len(rs[0]["curve"]))],
                      "gain_over_first_at_end": spread([r["curve"][-1] - b["curve"][-1]
                                                        for r, b in zip(rs, runs[base], strict=True)])}
               for name, rs in runs.items()}
    result = {"target": "tiny" if args.tiny else "smollm2", "steps": args.steps, "every": args.every,
              "records": {"train": len(train), "held_out": len(held_out), "rejected_drafts": rejected},
              "results": results}
    path = write_result(args.out, args, result)
    print(markdown(result, path.parent))


def markdown(result: dict[str, Any], out: Path) -> str:
    every, results = result["every"], result["results"]
    checkpoints = len(next(iter(results.values()))["checkpoints"])
    headers = ["negative_coef", *(f"step {every * (i + 1)}" for i in range(checkpoints)), "gain over first at end"]
    rows = [[name, *(cell(c, 3) for c in r["checkpoints"]), cell(r["gain_over_first_at_end"], 3)]
            for name, r in results.items()]
    text = markdown_table(headers, rows)
    text += (f"\n\nTarget {result['target']}; {result['records']['train']} training records with "
             f"{result['records']['rejected_drafts']} rejected drafts, {result['records']['held_out']} held out; "
             "simulated accept length at k = 4 on the held-out records, median (min–max) over seeds.")
    groups = {"simulated accept length": {name: [c[-1] for c in r["curves"]] for name, r in results.items()}}
    path = dot_plot(groups, f"after {result['steps']} learner steps (each dot one seed)", "accept length",
                    out / "negative_term.png")
    return text + f"\n\n![negative term]({path.name})"


if __name__ == "__main__":
    main()
