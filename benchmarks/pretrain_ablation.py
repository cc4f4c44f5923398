"""Pretraining ablations at equal training time, and the chosen drafter's accept length against k.

Each arm is one `specd pretrain` run in its own work folder (resumable: rerun to continue), on one
torch thread, stopped at `--seconds` of training time; arms run `--parallel` at a time so that each
shares the machine alike. Arms differ from the shipped recipe in one setting each:
- `shipped`: the shipped recipe (the target's own responses, draft vocabulary 8192);
- `sharegpt`: ShareGPT's own text of 1200 training conversations instead of the target's responses;
- `vocab16k`: a draft vocabulary of 16384;
- `two_layers`: two drafter decoder layers instead of EAGLE-3's one (the second a plain Llama layer);
- `greedy_only`: the greedy answers of the same generated data only (a quarter of it), not the sampled ones;
- `answers_only`: prompt positions weigh 0 (the recipe's 0.2), so a step skips the prompts'
  queries, chains and labels (their keys remain: answers attend to them) and covers more answers
  (the recipe's own setting since f3802b9, so today the same as `shipped`);
- `target_layer_init`: the drafter layer starts from the target's last layer (`--init target_layer`);
- `lr_double`: learning rate 1.2e-3 instead of the recipe's 6e-4;
- `later_turns`: every later user turn answered too (`--later-turns`: 6781 prompts instead of 2243),
  its context trimmed from the front to fit: three times the distinct prompts of one round.
Generated data and held-out sets are made once (`--share`: read from the shipped run's folder);
an arm whose flags change the generated data (`DATA_FLAGS`) shares the held-out sets only, and
makes its own data unless its folder already holds (or links to) it.
An arm already run further (the shipped recipe's own folder, continued to its full length) is read,
not rerun: its curve is compared at the same training seconds. `report` tabulates, for every arm,
the validation and evaluation accept length (k = 4, greedy, simulated exactly) at the budget
(linear between the curve points around it), its steps and tokens, and draws the curves against training seconds;
with `--drafter` it also replays that drafter's held-out sets at k = 3..6. Settings are compared
on the validation figure; the evaluation figure is reported beside it, never used to choose.
Writes out/pretrain_ablation.json (+ .md, .png).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import markdown_table, parser, write_result

ARMS: dict[str, list[str]] = {
    "shipped": ["--recipe", "shipped"],
    "sharegpt": ["--recipe", "shipped", "--data", "sharegpt"],
    "vocab16k": ["--recipe", "shipped", "--draft-vocab", "16384"],
    "two_layers": ["--recipe", "shipped", "--drafter-layers", "2"],
    "greedy_only": ["--recipe", "shipped", "--greedy-only"],
    "answers_only": ["--recipe", "shipped", "--prompt-weight", "0"],
    "target_layer_init": ["--recipe", "shipped", "--init", "target_layer"],
    "lr_double": ["--recipe", "shipped", "--lr", "1.2e-3"],
    "later_turns": ["--recipe", "shipped", "--later-turns"],
}
DATA_FLAGS = ("--later-turns",)  # an arm with one of these generates data of its own


SHARED = ("distilled", "validation.safetensors", "evaluation.safetensors")  # the same for every arm


def run_arm(name: str, root: Path, seconds: float, share: Path | None, common: list[str]) -> int:
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    own_data = any(flag in ARMS[name] for flag in DATA_FLAGS)
    for item in SHARED:
        if own_data and item == "distilled":
            continue
        if share is not None and (share / item).exists() and not (work / item).exists():
            (work / item).symlink_to((share / item).resolve())  # generated once, read by every arm
    command = [sys.executable, "-m", "specd.cli.main", "pretrain", *ARMS[name], *common, "--work", str(work),
               "--out", str(work / "drafter.safetensors"), "--threads", "1", "--max-seconds", str(seconds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(work / "run.log", "ab") as log:
        return subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def at_seconds(curve: list[dict[str, Any]], seconds: float, axis: str = "seconds") -> dict[str, Any]:
    """The curve at `seconds` of training (or at that value of another `axis`, e.g. "step"): linear
    between the two points around it (the last point if the arm stopped before, within 2% of the budget)."""
    after = next((i for i, p in enumerate(curve) if p[axis] >= seconds), None)
    if after is None or after == 0:
        point = dict(curve[-1] if after is None else curve[0])
        point["interpolated"] = False
        return point
    a, b = curve[after - 1], curve[after]
    share = (seconds - a[axis]) / max(b[axis] - a[axis], 1e-9)
    point = {key: a[key] + share * (b[key] - a[key]) for key in ("step", "tokens", "seconds",
                                                                  "validation_accept_length",
                                                                  "evaluation_accept_length")}
    point["interpolated"] = True
    return point


def accept_by_k(drafter: Path, work: Path, ks: list[int]) -> dict[str, dict[str, float]]:
    from specd.drafter.checkpoint import load_drafter
    from specd.drafter.feature_model import FeatureDrafterModel
    from specd.learner.simulation import simulated_counts
    from specd.model.target import LoadedTarget
    from specd.offline.corpus import load_held_out

    loaded = LoadedTarget.load()
    # any drafter file, the earlier shipped one too (whose manifest predates the hashes)
    model = load_drafter(drafter, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    assert isinstance(model, FeatureDrafterModel), f"{drafter} is not a feature drafter"
    figures: dict[str, dict[str, float]] = {}
    for name in ("validation", "evaluation"):
        sets = load_held_out(work / f"{name}.safetensors")
        figures[name] = {str(k): round(simulated_counts(model, sets, k).accept_length or 0.0, 4) for k in ks}
    return figures


def plot(curves: dict[str, list[dict[str, Any]]], seconds: float, path: Path, at_step: int | None = None) -> None:
    """Accept length against training minutes, or against steps where the arms are compared `at_step`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, split in zip(axes, ("validation", "evaluation"), strict=True):
        for name, curve in curves.items():
            xs = [p["seconds"] / 60 if at_step is None else p["step"] for p in curve]
            axis.plot(xs, [p[f"{split}_accept_length"] for p in curve], marker="o", label=name)
        axis.axvline(seconds / 60 if at_step is None else at_step, color="grey", linestyle=":")
        axis.set_title(f"{split} prompts, k = 4, greedy")
        axis.set_xlabel("training minutes (one thread)" if at_step is None else "training steps")
    axes[0].set_ylabel("accept length")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    p = parser(__doc__, "out/pretrain_ablation.json", repeats=1)
    p.add_argument("action", choices=["run", "report"])
    p.add_argument("--root", default="/work/pretrain-ablation", help="one work folder per arm under it")
    p.add_argument("--arms", nargs="+", default=["sharegpt", "vocab16k"], choices=sorted(ARMS))
    p.add_argument("--seconds", type=float, default=1500, help="training seconds per arm")
    p.add_argument("--at-step", type=int, default=None, help="report: compare the arms at this step instead "
                   "of at --seconds (arms trained at different thread counts or beside other jobs)")
    p.add_argument("--parallel", type=int, default=1, help="arms run at once (each on one thread)")
    p.add_argument("--read", nargs="*", default=[], metavar="NAME=WORK",
                   help="arms already run elsewhere, e.g. shipped=/work/pretrain-shipped/train")
    p.add_argument("--share", default=None, help="run: a work folder whose generated data and held-out sets "
                   "every arm reads instead of making its own")
    p.add_argument("--common", default="", help="run: flags every arm adds to its own, e.g. "
                   "'--distill-rounds 1' (the first round of the shared data only)")
    p.add_argument("--drafter", nargs="*", default=[], help="report: replay these drafters on the held-out sets "
                   "at k = 3..6")
    args = p.parse_args()
    root = Path(args.root)
    if args.action == "run":
        with ThreadPoolExecutor(args.parallel) as pool:
            share = Path(args.share) if args.share else None
            common = args.common.split()
            codes = list(pool.map(lambda name: run_arm(name, root, args.seconds, share, common), args.arms))
        return max(codes)
    folders = {name: root / name for name in args.arms}
    folders.update({name: Path(work) for name, work in (item.split("=", 1) for item in args.read)})
    curves = {name: json.loads((work / "curve.json").read_text()) for name, work in folders.items()}
    rows, arms = [], {}
    for name, curve in curves.items():
        point = at_seconds(curve, args.seconds) if args.at_step is None else at_seconds(curve, args.at_step, "step")
        arms[name] = {"work": str(folders[name]), "at_budget": point, "curve": curve,
                      "settings": json.loads((folders[name] / "config.json").read_text())}
        rows.append([name, round(point["step"]), round(point["tokens"]), round(point["seconds"]),
                     f"{point['validation_accept_length']:.3f}", f"{point['evaluation_accept_length']:.3f}"])
    table = markdown_table(["arm", "steps", "tokens trained", "training s", "validation accept len",
                            "evaluation accept len"], rows)
    result: dict[str, Any] = {"seconds": args.seconds, "at_step": args.at_step, "arms": arms, "table": table}
    if args.drafter:
        # the held-out sets every arm shares, replayed at k = 3..6 for each drafter named
        work = folders.get("shipped", next(iter(folders.values())))
        by_k = {Path(path).name: accept_by_k(Path(path), work, [3, 4, 5, 6]) for path in args.drafter}
        result["accept_by_k"] = by_k
        result["k_table"] = markdown_table(
            ["drafter", "split", "k = 3", "k = 4", "k = 5", "k = 6"],
            [[name, split, *figures.values()] for name, splits in by_k.items() for split, figures in splits.items()])
    out = write_result(args.out, args, result)
    plot(curves, args.seconds, out.with_suffix(".png"), args.at_step)
    out.with_suffix(".md").write_text(table + "\n\n" + result.get("k_table", "") + "\n")
    print(table)
    print(result.get("k_table", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
