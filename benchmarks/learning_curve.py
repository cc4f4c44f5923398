"""Learning curves: held-out accept length against records received and tokens trained, per drafter.

SmolLM2 serves held-out ShareGPT prompts (from the evaluation reserve, which `specd pretrain`
never trains on) greedily with no drafter; its outputs become id-only trajectory records (as a
vLLM server ships them), produced once and shared by every curve, and the engine's own tokens/s
on that run is the served rate. The prompts are split into a training stream and a disjoint
evaluation set (checked). Each curve is the service's own `Learner` (default `LearnerConfig`
hyper-parameters, its own objective and AdamW, an in-process bus, a temporary weight store; the
gate is off) starting from a day-0 drafter: the feature drafter from scratch, the feature drafter
from the shipped pretrained version (reported as missing, not run, while the file is absent or
does not fit), and the token-level drafter (which has no pretrained version). Records arrive in
order, `--per-round` at a time, each round followed by `--steps-per-round` learner steps; after
every round the drafter's accept length on the evaluation records is simulated exactly (greedy,
teacher-forced, k = 4). Also per curve: training seconds, tokens trained per second and, for the
feature drafter, the cost of recomputing the target's features for id-only records, so that
"trained tokens/s >= served tokens/s" can be read off. `--repeats` trains each curve with that
many seeds on the same records. Writes JSON (default out/learning_curve.json), a PNG beside it
(learning_curve.png) and prints markdown tables. `--quick`: a 1–2 minute smoke version.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import cell, markdown_table, parser, spread, write_result

from specd.core.errors import CheckpointError
from specd.core.records import TrajectoryRecord, validate_record
from specd.core.traffic import load_humaneval, load_sharegpt
from specd.drafter.factory import DrafterSpec, initial_model
from specd.drafter.pretrained import SHIPPED_DRAFTER, load_pretrained
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.objectives import FeatureObjective
from specd.model.target import LoadedTarget
from specd.transport.bus import InProcessBus

# name: (arch, from the pretrained version)
CURVES = {"feature-scratch": ("feature", False), "feature-pretrained": ("feature", True),
          "token-scratch": ("token", False)}
K = 4
FULL = {"records": 64, "held_out": 16, "per_round": 8, "steps_per_round": 5, "max_tokens": 64}
QUICK = {"records": 16, "held_out": 6, "per_round": 8, "steps_per_round": 2, "max_tokens": 32}


# ---- records ----------------------------------------------------------------------------------
def make_records(loaded: LoadedTarget, count: int, held_out: int, max_tokens: int, seed: int,
                 domain: str = "sharegpt") -> tuple[list[TrajectoryRecord], list[TrajectoryRecord], dict[str, Any]]:
    """The target's own greedy outputs on disjoint training and evaluation prompts, and the served rate."""
    from specd.demo.deployment import encode

    load = load_sharegpt if domain == "sharegpt" else load_humaneval
    items = load(count + held_out, seed)
    if len(items) < count + held_out:
        raise SystemExit(f"only {len(items)} {domain} prompts available, {count + held_out} asked for")
    train_items, eval_items = items[:count], items[count:]
    overlap = {(i.messages, i.prompt) for i in train_items} & {(i.messages, i.prompt) for i in eval_items}
    assert not overlap, f"{len(overlap)} prompts are both training and evaluation prompts"
    prompts = [encode(loaded, item) for item in items]
    longest = max(len(p) for p in prompts) + max_tokens
    engine = Engine(loaded.model, None, EngineConfig(max_batch=8, max_context=longest,
                                                     eos_token_ids=loaded.eos_token_ids))
    begin = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - begin
    vocab = loaded.model.config.vocab_size
    records = [validate_record(record_from_sequence(s, "learning-curve", time.time(), item.domain).to_dict(), vocab)
               for s, item in zip(seqs, items, strict=True)]
    output_tokens = sum(len(s.output_ids) for s in seqs)
    served = {"requests": len(seqs), "prompt_tokens": sum(len(s.prompt_ids) for s in seqs),
              "output_tokens": output_tokens, "seconds": round(seconds, 2),
              "tokens_per_s": round(output_tokens / seconds, 1), "max_batch": 8}
    return records[:count], records[count:], served


def pretrained_status(loaded: LoadedTarget) -> str | None:
    """None when the shipped pretrained feature drafter is there and fits this target, else why not."""
    if not SHIPPED_DRAFTER.is_file():
        return f"pretrained version not found ({SHIPPED_DRAFTER.relative_to(SHIPPED_DRAFTER.parents[2])})"
    try:
        load_pretrained(SHIPPED_DRAFTER, loaded.model, loaded.fingerprint)
    except CheckpointError as error:
        return f"pretrained version not usable: {error}"
    return None


# ---- one curve --------------------------------------------------------------------------------
class Recompute:
    """Feature recomputation (id-only records) attributed to training or evaluation."""

    def __init__(self, learner: Learner) -> None:
        objective = learner.objective
        self.objective = objective if isinstance(objective, FeatureObjective) else None
        self.totals = {"train": [0, 0, 0.0], "eval": [0, 0, 0.0]}  # records, tokens, seconds

    def _now(self) -> tuple[int, int, float]:
        o = self.objective
        return (o.recomputed_records, o.recomputed_tokens, o.recomputed_seconds) if o else (0, 0, 0.0)

    def measure(self, part: str, work: Any) -> Any:
        before = self._now()
        value = work()
        for i, (a, b) in enumerate(zip(before, self._now(), strict=True)):
            self.totals[part][i] += b - a
        return value

    def stats(self, part: str) -> dict[str, Any] | None:
        if self.objective is None:
            return None
        records, tokens, seconds = self.totals[part]
        return {"records": records, "tokens": tokens, "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / seconds, 1) if seconds else None}


def run_curve(name: str, loaded: LoadedTarget, train: list[TrajectoryRecord], held_out: list[TrajectoryRecord],
              args: Any, seed: int) -> dict[str, Any]:
    arch, pretrained = CURVES[name]
    torch.manual_seed(seed)
    initial = initial_model(loaded.model, DrafterSpec(arch=arch, pretrained=pretrained), seed=seed,
                            fingerprint=loaded.fingerprint)
    # the service's hyper-parameters; only the gate is off (this benchmark holds out its own records)
    config = LearnerConfig(duty_cycle=1.0, holdout_every=10**9, publish_every_steps=10**9,
                           publish_every_seconds=math.inf, k=K, seed=seed,
                           feature_learning_rate=args.feature_lr or LearnerConfig.feature_learning_rate)
    embedding = loaded.model.embed.weight
    with tempfile.TemporaryDirectory(prefix="learning-curve-") as tmp:
        learner = Learner(config, InProcessBus(), WeightStore(tmp), initial, loaded.fingerprint, embedding.dtype,
                          embedding, target=loaded.model)
        capacity = learner.buffer.maxlen or 0
        if len(train) > capacity:
            print(f"  note: {len(train)} records exceed the learner's buffer ({capacity}); the oldest are dropped")
        recompute = Recompute(learner)

        def evaluate() -> float:
            learner.model.eval()
            try:
                return recompute.measure("eval", lambda: learner.simulated_accept_length(learner.model, held_out))
            finally:
                learner.model.train()

        points = [{"records": 0, "record_tokens": 0, "steps": 0, "tokens_trained": 0, "train_s": 0.0,
                   "loss": None, "accept_length": evaluate()}]
        train_s = 0.0
        received = record_tokens = 0
        for start in range(0, len(train), args.per_round):
            batch = train[start:start + args.per_round]
            for record in batch:
                learner.bus.publish(record.to_dict())
            taken = learner.intake()
            assert taken == len(batch) and not learner.stats.refused, (taken, dict(learner.stats.refused))
            received += len(batch)
            record_tokens += sum(r.num_tokens for r in batch)
            losses = []
            if len(learner.buffer) >= config.min_records:
                for _ in range(args.steps_per_round):
                    begin = time.perf_counter()
                    losses.append(recompute.measure("train", learner.train_step))
                    train_s += time.perf_counter() - begin
            points.append({"records": received, "record_tokens": record_tokens, "steps": learner.stats.steps,
                           "tokens_trained": learner.stats.tokens_trained, "train_s": round(train_s, 2),
                           "loss": statistics.fmean(losses) if losses else None, "accept_length": evaluate()})
            print(f"  {name} seed {seed}: {received} records, {learner.stats.tokens_trained} tokens trained, "
                  f"accept length {points[-1]['accept_length']:.3f} ({train_s:.0f} s training)", flush=True)
        tokens = learner.stats.tokens_trained
        train_recompute = recompute.stats("train")
        recompute_s = train_recompute["seconds"] if train_recompute else 0.0
        return {"seed": seed, "points": points, "steps": learner.stats.steps, "tokens_trained": tokens,
                "records_trained": learner.stats.records_trained, "train_s": round(train_s, 2),
                "tokens_per_s": round(tokens / train_s, 1) if train_s else None,
                "tokens_per_s_without_recompute": (round(tokens / (train_s - recompute_s), 1)
                                                   if train_s > recompute_s else None),
                "recompute": {"train": train_recompute, "eval": recompute.stats("eval")},
                "parameters_trained": sum(p.numel() for p in learner.model.parameters() if p.requires_grad)}


# ---- main -------------------------------------------------------------------------------------
def main() -> None:
    p = parser(__doc__, "out/learning_curve.json", repeats=1)
    p.add_argument("--quick", action="store_true", help="the 1–2 minute smoke version (sizes below default to "
                   + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ")")
    p.add_argument("--records", type=int, default=None, help=f"training records (default {FULL['records']})")
    p.add_argument("--held-out", type=int, default=None, help=f"evaluation records (default {FULL['held_out']})")
    p.add_argument("--per-round", type=int, default=None, help=f"records per round (default {FULL['per_round']})")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help=f"learner steps after each round's records (default {FULL['steps_per_round']})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"output tokens per record (default {FULL['max_tokens']})")
    p.add_argument("--curves", default=",".join(CURVES),
                   help="which curves (comma-separated: " + ",".join(CURVES) + ")")
    p.add_argument("--domain", choices=["sharegpt", "humaneval"], default="sharegpt",
                   help="the traffic: held-out ShareGPT chats (default) or HumanEval code (the shift the "
                        "pretrained drafter never saw)")
    p.add_argument("--feature-lr", type=float, default=None,
                   help="the feature drafter's learning rate (default: LearnerConfig's, as the service runs)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed; training seeds are seed..seed+repeats-1")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n.strip() for n in args.curves.split(",") if n.strip()]
    unknown = [n for n in names if n not in CURVES]
    if unknown:
        p.error(f"unknown curves {unknown}; choose from {list(CURVES)}")
    torch.set_grad_enabled(True)

    loaded = LoadedTarget.load(None)
    train, held_out, served = make_records(loaded, args.records, args.held_out, args.max_tokens, args.seed,
                                           args.domain)
    print(f"{len(train)} training records, {len(held_out)} evaluation records (disjoint prompts); served "
          f"{served['output_tokens']} tokens at {served['tokens_per_s']} tokens/s without a drafter", flush=True)
    missing: dict[str, str] = {}
    if "feature-pretrained" in names and (why := pretrained_status(loaded)) is not None:
        missing["feature-pretrained"] = why
        print(f"feature-pretrained: {why}; skipping that curve", flush=True)
    curves: dict[str, dict[str, Any]] = {}
    for name in names:
        if name in missing:
            curves[name] = {"missing": missing[name]}
            continue
        runs = [run_curve(name, loaded, train, held_out, args, args.seed + r) for r in range(args.repeats)]
        curves[name] = {"arch": CURVES[name][0], "pretrained": CURVES[name][1], "runs": runs}
    result = {"target": "smollm2-135m-instruct", "k": K, "sizes": {key: getattr(args, key) for key in FULL},
              "learner_config": {key: getattr(LearnerConfig(), key) for key in LearnerConfig.__dataclass_fields__},
              "records": {"train": len(train), "held_out": len(held_out),
                          "train_tokens": sum(r.num_tokens for r in train),
                          "held_out_output_tokens": sum(len(r.output_ids) for r in held_out)},
              "served": served, "curves": curves}
    path = write_result(args.out, args, result)
    print(markdown(result, path.parent))


# ---- showing it -------------------------------------------------------------------------------
def markdown(result: dict[str, Any], out: Path) -> str:
    curves, served = result["curves"], result["served"]
    present = {n: c for n, c in curves.items() if "runs" in c}
    rounds = max((len(c["runs"][0]["points"]) for c in present.values()), default=0)
    some = next(iter(present.values()), None)
    received = [pt["records"] for pt in some["runs"][0]["points"]] if some else []
    headers = ["drafter", *(f"{r} records" for r in received)] if received else ["drafter", "accept length"]
    rows: list[list[Any]] = []
    for name, c in curves.items():
        if "runs" not in c:
            rows.append([name, f"missing: {c['missing']}", *([""] * (len(headers) - 2))])
            continue
        rows.append([name, *(cell(spread([run["points"][i]["accept_length"] for run in c["runs"]]), 3)
                             for i in range(rounds))])
    text = "Held-out accept length (simulated, greedy, k = {k}) after each round's training:\n\n".format(k=result["k"])
    text += markdown_table(headers, rows)

    def stat(c: dict[str, Any], get: Any, digits: int = 1) -> str:
        values = [get(run) for run in c["runs"]]
        return "n/a" if all(v is None for v in values) else cell(spread(values), digits)

    cost_rows = []
    for name, c in present.items():
        last = [run["points"][-1] for run in c["runs"]]
        keeps_up = [run["tokens_per_s"] is not None and run["tokens_per_s"] >= served["tokens_per_s"]
                    for run in c["runs"]]
        cost_rows.append([
            name, stat(c, lambda r: r["steps"], 0), cell(spread([p["tokens_trained"] for p in last]), 0),
            stat(c, lambda r: r["train_s"]), stat(c, lambda r: r["tokens_per_s"]),
            stat(c, lambda r: r["tokens_per_s_without_recompute"]),
            stat(c, lambda r: (r["recompute"]["train"] or {}).get("tokens_per_s")),
            stat(c, lambda r: (r["recompute"]["train"] or {}).get("seconds")),
            f"{served['tokens_per_s']:.1f}", "yes" if all(keeps_up) else ("no" if not any(keeps_up) else "some seeds")])
    text += "\n\n" + markdown_table(
        ["drafter", "steps", "tokens trained", "training s", "trained tokens/s", "trained tokens/s w/o recompute",
         "feature recompute tokens/s", "recompute s (training)", "served tokens/s", "trained ≥ served"], cost_rows)
    records = result["records"]
    sizes = result["sizes"]
    text += (f"\n\n{records['train']} training records ({records['train_tokens']} prompt + output tokens), "
             f"{sizes['per_round']} per round, {sizes['steps_per_round']} learner steps per round (batch "
             f"{result['learner_config']['batch_size']}); {records['held_out']} evaluation records on disjoint "
             f"prompts ({records['held_out_output_tokens']} output tokens); records are id-only, so the feature "
             "drafter's learner recomputes the target's features (included in its training seconds). Served: the "
             f"engine alone (batch {served['max_batch']}) made {served['output_tokens']} output tokens in "
             f"{served['seconds']:.1f} s. Tokens trained are the label positions the objective weighs; cells are "
             "median (min–max) over seeds.")
    if present:
        path = plot(result, out / "learning_curve.png")
        text += f"\n\n![learning curves]({path.name})"
    return text


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    missing = []
    for index, (name, c) in enumerate(result["curves"].items()):
        if "runs" not in c:
            missing.append(f"{name}: {c['missing']}")
            continue
        for number, run in enumerate(c["runs"]):
            points = run["points"]
            ys = [pt["accept_length"] for pt in points]
            label = name if number == 0 else None
            colour = colours[index % len(colours)]
            axes[0].plot([pt["records"] for pt in points], ys, "o-", color=colour, label=label, alpha=0.8, ms=3)
            axes[1].plot([pt["tokens_trained"] for pt in points], ys, "o-", color=colour, label=label, alpha=0.8, ms=3)
    for ax, xlabel in zip(axes, ["records received", "tokens trained"], strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"held-out accept length (k = {result['k']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = "Learning curves (SmolLM2-135M, id-only records)"
    if missing:
        title += "\n" + "; ".join(missing)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
