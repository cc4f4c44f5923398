"""Which versions each gate rule lets through, against what they are worth on many more records.

Contract: one training run of the service's own `Learner` (`LearnerConfig`'s defaults: float32, no
anchor; `--learner demo`: the demo's `DEMO_LEARNER`) from the shipped pretrained drafter, fed
`--chat` ShareGPT chats and then `--code` HumanEval problems (the validation items of
`demo_learner_sweep.py`: none the demo serves, none pretraining saw), `--per-round` at a time with
`--steps-per-round` steps after each; every `--holdout-every`-th record is held out for the gates
instead (the newest 16 kept, as the service's gate keeps them). After each round the trained
drafter is a candidate, and every arm (`--arms`: comma-separated `z:margin[:window]`,
`Gate.confidence_z`, `Gate.margin` and `Gate.traffic_window`, which then sees the domain of every
record served; a fourth field of 1 judges only on records held out after the arm's last pass)
judges it against its own live version and bar with `specd.learner.gate.Gate`,
exactly as the learner does (a pass makes it that arm's live version; one that passes without the
margin, its bar), once it holds `--min-held-out` records (default: the learner's own). The truth
is each version's accept length on `--truth` further records of each domain (greedy, k = 4, exact
replay), judged on the domain being served. Reported per arm: versions passed, passes that were
worse than the live version they replaced on the served domain's truth (by more than 0.02), and
refusals of versions better by more than 0.02; and its live version's truth after every round.
Writes JSON (default out/gate_evidence.json) and prints a markdown table.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import replace
from typing import Any

import torch
from common import markdown_table, parser, write_result
from demo_learner_sweep import feed_round, make_records, sweep_learner, validation_items

from specd.core.records import TrajectoryRecord
from specd.demo.deployment import DEMO_LEARNER
from specd.drafter.checkpoint import DrafterModel
from specd.learner.config import LearnerConfig
from specd.learner.gate import Gate
from specd.learner.learner import Learner
from specd.model.target import LoadedTarget

K = 4
LEARNERS = {"service": LearnerConfig(), "demo": DEMO_LEARNER}
NOTICEABLE = 0.02  # a difference in truth smaller than this is not counted as a wrong verdict


class Arm:
    def __init__(self, spec: str, start: DrafterModel, min_held_out: int) -> None:
        z, margin, *rest = (float(part) for part in spec.split(":"))
        self.spec = spec
        self.gate = Gate(1, LearnerConfig.holdout_capacity, min_held_out, margin,
                         traffic_window=int(rest[0]) if rest else 0, confidence_z=z)
        # fresh: after a pass, judge on held-out records that arrive afterwards only (the records a
        # version was chosen on flatter it: the best of several candidates on them is biased high)
        self.fresh = len(rest) > 1 and rest[1] > 0
        self.live, self.bar = start, start
        self.log: list[dict[str, Any]] = []

    def judge(self, candidate: DrafterModel, learner: Learner, truth: dict[str, float],
              live_truth: dict[str, float], served: str) -> None:
        bar = None if self.bar is self.live else self.bar
        verdict = self.gate.verdict(candidate, self.live, learner.simulated_accept_length, bar=bar)
        gain = truth[served] - live_truth[served]
        self.log.append({"passed": verdict["passed"], "verdict": _rounded(verdict), "served": served,
                         "truth_gain": round(gain, 4), "candidate_truth": truth})
        if verdict["passed"]:
            self.live = candidate
            if verdict.get("improved", True):
                self.bar = candidate
            if self.fresh:
                self.gate.held_out.clear()


def _rounded(verdict: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in verdict.items()}


def evaluate(learner: Learner, model: DrafterModel, truth: dict[str, list[TrajectoryRecord]]) -> dict[str, float]:
    return {domain: round(learner.simulated_accept_length(model, records), 4) for domain, records in truth.items()}


def main() -> None:
    p = parser(__doc__, "out/gate_evidence.json", 1)
    p.add_argument("--arms", default="0:0.05,0:0,1:0.05,1.64:0")
    p.add_argument("--chat", type=int, default=40, help="chat records served before the code")
    p.add_argument("--code", type=int, default=24, help="code records served after the chats")
    p.add_argument("--truth", type=int, default=24, help="records of each domain that judge the versions")
    p.add_argument("--learner", choices=sorted(LEARNERS), default="service",
                   help="whose learner trains: the service's defaults or the demo's")
    p.add_argument("--holdout-every", type=int, default=4)
    p.add_argument("--min-held-out", type=int, default=None, help="default: the learner's own")
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = LoadedTarget.load()
    # each record named by its domain (make_records names them all humaneval): the traffic window reads it
    chat = [replace(r, domain="chat") for r in
            make_records(loaded, validation_items(args.chat + args.truth, "sharegpt"), args.max_tokens)]
    code = [replace(r, domain="code") for r in make_records(loaded, validation_items(args.code + args.truth),
                                                            args.max_tokens)]
    stream = [("chat", r) for r in chat[:args.chat]] + [("code", r) for r in code[:args.code]]
    truth = {"chat": chat[args.chat:], "code": code[args.code:]}
    with tempfile.TemporaryDirectory(prefix="gate-evidence-") as folder:
        config = LEARNERS[args.learner]
        learner = sweep_learner(loaded, config, folder)
        start = copy.deepcopy(learner.model).eval()
        min_held_out = config.gate_min_held_out if args.min_held_out is None else args.min_held_out
        arms = [Arm(spec, start, min_held_out) for spec in args.arms.split(",")]
        truths = {id(start): evaluate(learner, start, truth)}
        rounds = []
        for begin in range(0, len(stream), args.per_round):
            part = stream[begin:begin + args.per_round]
            held = [r for i, (_, r) in enumerate(part, begin + 1) if i % args.holdout_every == 0]
            feed_round(learner, [r for _, r in part if all(r is not h for h in held)], args.steps_per_round)
            for arm in arms:
                arm.gate.keep(held)
                if arm.gate.traffic_window:
                    arm.gate.recent_domains.extend(r.domain for _, r in part)
            candidate = copy.deepcopy(learner.model).eval()
            truths[id(candidate)] = evaluate(learner, candidate, truth)
            served = part[-1][0]
            for arm in arms:
                if arm.gate.has_evidence:
                    arm.judge(candidate, learner, truths[id(candidate)], truths[id(arm.live)], served)
            rounds.append({"records": begin + len(part), "served": served, "candidate": truths[id(candidate)],
                           "live": {arm.spec: truths[id(arm.live)] for arm in arms}})
            print(f"  {begin + len(part)} records ({served}): candidate {truths[id(candidate)]}; live "
                  + "; ".join(f"{arm.spec} {truths[id(arm.live)]}" for arm in arms), flush=True)
    summary = []
    for arm in arms:
        passed = [e for e in arm.log if e["passed"]]
        summary.append({"arm": arm.spec, "judged": len(arm.log), "passed": len(passed),
                        "passed_worse": sum(e["truth_gain"] < -NOTICEABLE for e in passed),
                        "refused_better": sum(e["truth_gain"] > NOTICEABLE for e in arm.log if not e["passed"]),
                        "live_at_end": truths[id(arm.live)], "log": arm.log})
    print(markdown_table(["z:margin", "judged", "passed", "passed, worse", "refused, better", "live at end"],
                         [[s["arm"], s["judged"], s["passed"], s["passed_worse"], s["refused_better"],
                           s["live_at_end"]] for s in summary]))
    write_result(args.out, args, {"k": K, "noticeable": NOTICEABLE, "day_0": truths[id(start)],
                                  "truth_records": {d: len(r) for d, r in truth.items()}, "rounds": rounds,
                                  "arms": summary})


if __name__ == "__main__":
    main()
