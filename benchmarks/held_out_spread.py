"""How sure a held-out accept length is: per-prompt figures of drafter files, bootstrapped.

Contract: for each version file in `--drafters` (the first is the baseline) and each held-out set of
a `specd pretrain` work folder (`validation.safetensors`, `evaluation.safetensors`), replays the
drafter exactly as pretraining's curve does (k = `--k`, greedy, teacher-forced) prompt by prompt,
and reports the pooled accept length (tokens emitted / target passes, the curve's figure), a 95%
bootstrap interval over prompts, and the paired difference to the baseline with its interval (the
same resampled prompts for both files, so the prompts' own difficulty cancels). Writes `--out`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parser, write_result

from specd.drafter.pretrained import load_pretrained
from specd.learner.simulation import simulated_counts
from specd.model.target import LoadedTarget
from specd.offline.corpus import load_held_out


def per_prompt(model, held_out, k: int) -> np.ndarray:
    """[prompts, 2]: target passes and tokens emitted of each prompt."""
    model.eval()
    rows = []
    with torch.no_grad():
        for item in held_out:
            counts = simulated_counts(model, [item], k)
            rows.append((counts.passes, counts.emitted))
    return np.array(rows, dtype=np.float64)


def interval(values: np.ndarray) -> list[float]:
    return [round(float(np.percentile(values, 2.5)), 4), round(float(np.percentile(values, 97.5)), 4)]


def main() -> int:
    p = parser(__doc__, "benchmarks/results/held_out_spread.json", repeats=1)
    p.add_argument("--work", required=True, help="a `specd pretrain` work folder holding the held-out sets")
    p.add_argument("--drafters", nargs="+", required=True, help="version files; the first is the baseline")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--resamples", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = LoadedTarget.load(None)
    work = Path(args.work)
    result: dict[str, dict] = {}
    for name in ("validation", "evaluation"):
        path = work / f"{name}.safetensors"
        if not path.is_file():
            raise SystemExit(f"{path}: no held-out set there (run `specd pretrain` with this work folder first)")
        held_out = load_held_out(path)
        figures = {drafter: per_prompt(load_pretrained(Path(drafter), loaded.model, loaded.fingerprint), held_out,
                                       args.k) for drafter in args.drafters}
        rng = np.random.default_rng(args.seed)
        draws = rng.integers(0, len(held_out), size=(args.resamples, len(held_out)))
        base = figures[args.drafters[0]]
        base_draws = base[draws].sum(axis=1)
        base_lengths = base_draws[:, 1] / base_draws[:, 0]
        result[name] = {"prompts": len(held_out)}
        for drafter, rows in figures.items():
            sums = rows[draws].sum(axis=1)
            lengths = sums[:, 1] / sums[:, 0]
            result[name][drafter] = {
                "accept_length": round(float(rows[:, 1].sum() / rows[:, 0].sum()), 4),
                "interval_95": interval(lengths),
                "difference_to_baseline": round(float(rows[:, 1].sum() / rows[:, 0].sum()
                                                      - base[:, 1].sum() / base[:, 0].sum()), 4),
                "difference_interval_95": interval(lengths - base_lengths),
                "share_of_resamples_above_baseline": round(float((lengths > base_lengths).mean()), 4),
            }
            print(f"{name:10s} {drafter}: {result[name][drafter]}")
    write_result(args.out, args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
