"""Choose the demo learner's online settings on validation traffic, never on the demo's.

The demo (`specd demo`) serves HumanEval problems `traffic.default_shift_traffic` picks and
reports its adaptation curve on `traffic.default_held_out`'s; this sweep draws its problems from
the rest of HumanEval (checked disjoint), and with `--chat-records N` first N ShareGPT chats the
demo does not serve (and N more held out), so the settings it picks are not tuned on the figures
they are then judged by. SmolLM2 answers them greedily with no drafter; the outputs become
records (ids only: the learner recomputes features, equal to carried ones). Each arm is the
service's own `Learner` with `DEMO_LEARNER`'s settings and one `feature_learning_rate` and
`anchor_pull`, starting from the shipped pretrained drafter, fed `--per-round` records at a time
(chats first, as in the demo) with `--steps-per-round` steps after each (the demo's learner makes
about 2.5 steps a request), and replayed on the held-out records of each domain after every round
(greedy, k = 4, exact). Reported per arm and seed: the curves, the code curve's mean over rounds
after the first (how fast it adapts) and its last point, and the chat curve's last point (what
learning cost the first domain). Writes JSON (default out/demo_learner_sweep.json; `--repeats`:
seeds) and prints a markdown table.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch
from common import markdown_table, parser, write_result

from specd.core.records import TrajectoryRecord, validate_record
from specd.core.traffic import (
    DEMO_REQUESTS,
    TrafficItem,
    default_held_out,
    default_shift_traffic,
    load_humaneval,
    load_sharegpt,
)
from specd.demo.deployment import DEMO_LEARNER, DemoConfig, encode
from specd.drafter.factory import DrafterSpec, initial_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.process import pin_serving, split_cores
from specd.model.target import LoadedTarget
from specd.transport.bus import InProcessBus

K = 4


def validation_items(count: int, domain: str = "humaneval") -> list[TrafficItem]:
    """HumanEval problems (or ShareGPT chats) that the default demo neither serves nor holds out."""
    demo = default_shift_traffic(DEMO_REQUESTS) + default_held_out(DEMO_REQUESTS)
    pool = load_humaneval(10**6, seed=1) if domain == "humaneval" else load_sharegpt(max(count, 1) * 8, seed=1)
    rest = [i for i in pool if i not in demo]
    if len(rest) < count:
        raise SystemExit(f"only {len(rest)} {domain} items lie outside the demo's, {count} asked for")
    return rest[:count]


def pinned_validation_traffic(loaded: LoadedTarget, requests: int, domains: tuple[str, ...] = ("sharegpt", "humaneval"),
                              ) -> tuple[list[TrafficItem], list[list[int]]]:
    """`requests` validation items of each domain in turn (`validation_items`) and their prompts, with
    serving pinned as the demo pins it (its serving cores, as many threads): what the serving A/Bs run on."""
    items = [item for domain in domains for item in validation_items(requests, domain)]
    prompts = [encode(loaded, item) for item in items]
    split = split_cores()
    if split is not None:
        pin_serving(split[0])
    return items, prompts


def make_records(loaded: LoadedTarget, items: list[TrafficItem], max_tokens: int) -> list[TrajectoryRecord]:
    """The target's greedy answers to `items`, as the records a server would send (each in its item's domain)."""
    prompts = [encode(loaded, item) for item in items]
    return answer_records(loaded, prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts),
                          [item.domain for item in items])


def answer_records(loaded: LoadedTarget, prompts: list[list[int]], params: list[SamplingParams],
                   domains: list[str], server_id: str = "sweep") -> list[TrajectoryRecord]:
    """The target alone answers each prompt with its params (no drafter); the answers as records,
    each labelled with its prompt's domain."""
    longest = max(len(p) for p in prompts) + max(sp.max_tokens for sp in params)
    engine = Engine(loaded.model, None, EngineConfig(max_batch=8, max_context=longest,
                                                     eos_token_ids=loaded.eos_token_ids))
    seqs = [engine.add_request(prompt, sp) for prompt, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    vocab = loaded.model.config.vocab_size
    return [validate_record(record_from_sequence(s, server_id, time.time(), domain).to_dict(), vocab)
            for s, domain in zip(seqs, domains, strict=True)]


# the gate and publishing off: a sweep holds out records of its own; training all the time
QUIET = dict(holdout_every=10**9, publish_every_steps=10**9, publish_every_seconds=math.inf, duty_cycle=1.0)


def sweep_learner(loaded: LoadedTarget, config: LearnerConfig, folder: str) -> Learner:
    """The service's own `Learner` from the shipped pretrained drafter (seeded by `config.seed`), with
    `QUIET`'s settings over `config` and its weight store in `folder`."""
    torch.manual_seed(config.seed)
    initial = initial_model(loaded.model, DrafterSpec(), seed=config.seed, fingerprint=loaded.fingerprint)
    embedding = loaded.model.embed.weight
    return Learner(replace(config, **QUIET), InProcessBus(), WeightStore(folder), initial,  # type: ignore[arg-type]
                   loaded.fingerprint, embedding.dtype, embedding, target=loaded.model)


def held_out_accept_lengths(learner: Learner, held_out: dict[str, list[TrajectoryRecord]]) -> dict[str, float]:
    """The learner's current drafter replayed on each domain's held-out records (in eval mode)."""
    learner.model.eval()
    try:
        return {domain: learner.simulated_accept_length(learner.model, records)
                for domain, records in held_out.items() if records}
    finally:
        learner.model.train()


def feed_round(learner: Learner, records: list[TrajectoryRecord], steps: int) -> None:
    """Hand `records` to the learner as the bus would, then train `steps` steps."""
    for record in records:
        learner.bus.publish(record.to_dict())
    learner.intake()
    for _ in range(steps):
        learner.train_step()


def run_arm(loaded: LoadedTarget, base: LearnerConfig, learning_rate: float, anchor_pull: float, seed: int,
            train: list[TrajectoryRecord], held_out: dict[str, list[TrajectoryRecord]], per_round: int,
            steps_per_round: int) -> dict[str, Any]:
    config = replace(base, feature_learning_rate=learning_rate, anchor_pull=anchor_pull, seed=seed)
    with tempfile.TemporaryDirectory(prefix="demo-sweep-") as tmp:
        learner = sweep_learner(loaded, config, tmp)
        curves: dict[str, list[float]] = {domain: [value] for domain, value in
                                          held_out_accept_lengths(learner, held_out).items()}
        for start in range(0, len(train), per_round):
            feed_round(learner, train[start:start + per_round], steps_per_round)
            for domain, value in held_out_accept_lengths(learner, held_out).items():
                curves[domain].append(value)
            print(f"  lr {learning_rate:g} pull {anchor_pull:g} seed {seed}: {start + per_round} records, "
                  + ", ".join(f"{d} {c[-1]:.3f}" for d, c in curves.items()), flush=True)
    code = curves["humaneval"]
    return {"learning_rate": learning_rate, "anchor_pull": anchor_pull, "seed": seed, "curve": code,
            "curves": curves, "mean_after_first_round": statistics.fmean(code[1:]), "last": code[-1]}


def main() -> None:
    p = parser(__doc__, "out/demo_learner_sweep.json", 1)
    p.add_argument("--rates", default="5e-5,1.5e-4,5e-4,1.5e-3", help="feature learning rates to compare")
    p.add_argument("--anchor-pulls", default=f"{DEMO_LEARNER.anchor_pull:g}",
                   help="anchor_pull settings to compare (each with every rate; default the demo's)")
    p.add_argument("--records", type=int, default=20, help="training records (the demo serves 20 of code)")
    p.add_argument("--held-out", type=int, default=12)
    p.add_argument("--chat-records", type=int, default=0,
                   help="chat records trained on before the code ones (the demo serves 20), and as many held out")
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--recent-share", type=float, default=DEMO_LEARNER.recent_share,
                   help="share of every batch drawn from the newest records")
    p.add_argument("--recent-records", type=int, default=DEMO_LEARNER.recent_records)
    p.add_argument("--max-tokens", type=int, default=DemoConfig.max_tokens)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = LoadedTarget.load()
    items = validation_items(args.records + args.held_out)
    records = make_records(loaded, items, args.max_tokens)
    chat_items = validation_items(2 * args.chat_records, "sharegpt")
    chat = make_records(loaded, chat_items, args.max_tokens) if chat_items else []
    train = chat[:args.chat_records] + records[:args.records]
    held_out = {"humaneval": records[args.records:], "sharegpt": chat[args.chat_records:]}
    base = replace(DEMO_LEARNER, recent_share=args.recent_share, recent_records=args.recent_records)
    arms = [run_arm(loaded, base, float(rate), float(pull), seed, train, held_out, args.per_round, args.steps_per_round)
            for seed in range(args.repeats) for pull in args.anchor_pulls.split(",") for rate in args.rates.split(",")]
    rows = []
    for setting in sorted({(a["learning_rate"], a["anchor_pull"]) for a in arms}):
        mine = [a for a in arms if (a["learning_rate"], a["anchor_pull"]) == setting]
        chat_last = [a["curves"]["sharegpt"][-1] for a in mine if "sharegpt" in a["curves"]]
        rows.append([f"{setting[0]:g}", f"{setting[1]:g}", f"{mine[0]['curve'][0]:.3f}",
                     f"{statistics.fmean(a['mean_after_first_round'] for a in mine):.3f}",
                     f"{statistics.fmean(a['last'] for a in mine):.3f}",
                     " / ".join(f"{a['last']:.3f}" for a in mine),
                     f"{statistics.fmean(chat_last):.3f}" if chat_last else "-"])
    print(markdown_table(["feature lr", "anchor pull", "day 0", "mean over rounds", "last", "last per seed",
                          "chat last"], rows))
    write_result(args.out, args, {
        "validation_problems": len(items), "chat_records": args.chat_records, "records": len(train),
        "held_out": {d: len(r) for d, r in held_out.items()}, "k": K, "per_round": args.per_round,
        "steps_per_round": args.steps_per_round, "max_tokens": args.max_tokens, "arms": arms})


if __name__ == "__main__":
    main()
