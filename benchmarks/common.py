"""What every benchmark shares: provenance, interleaved repeats, spread statistics, result files.

Contract:
- `provenance(args)`: where a figure came from: git commit and whether the tree was dirty (and
  which files) when the benchmark started (read at import, as is the load average), the
  versions of Python, torch, transformers and vLLM (None when not installed), the CPU model and
  core count, thread settings (torch's pools and the OMP/MKL/vLLM/specd environment), the
  command line and every setting of the run (the argparse namespace); `specd.core.provenance`
  computes it, as for `specd demo`'s JSON.
- `parser(doc, out, repeats)`: an ArgumentParser with `--out` and `--repeats` (None: without it) on it.
- `interleaved(configs, repeats)`: runs configurations in rounds, each once per round (A B C,
  B C A, C A B, ...: the starting one rotates so that no configuration always runs first), and
  returns every run, tagged with its round. Drift on a shared machine then hits all alike.
- `spread(values)`: median, quartiles, min, max and n; `paired(runs, a, b, field)`: the spread
  of per-round ratios a/b (each ratio from one round, so slow drift cancels).
- `write_result(path, args, result)`: the result plus its provenance (and the run's duration) as JSON.
- `cell(spread)`, `markdown_table(...)`, `dot_plot(...)`: how the report shows them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specd.core.provenance import provenance as run_provenance
from specd.core.provenance import state_at_start

STARTED = time.time()


# ---- provenance (specd.core.provenance: specd's main job records the same) -------------------
AT_START = state_at_start()  # read at import: the tree and the load may have changed when the result is written


def provenance(args: argparse.Namespace | Mapping[str, Any] | None = None) -> dict[str, Any]:
    settings = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return run_provenance(AT_START, STARTED, settings)


def parser(doc: str | None, out: str, repeats: int | None) -> argparse.ArgumentParser:
    """A benchmark's parser, with `--out` and (unless `repeats` is None: one run, no rounds) `--repeats`."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats,
                       help=f"rounds of interleaved configurations; medians and spread are reported "
                            f"(default {repeats})")
    p.add_argument("--out", default=out, help=f"JSON result (default {out})")
    return p


def write_result(path: str | Path, args: argparse.Namespace, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = provenance(args)
    info["seconds"] = round(time.time() - STARTED, 1)
    path.write_text(json.dumps({"provenance": info, **result}, indent=2))
    print(f"written to {path} ({info['seconds']:.0f} s)", flush=True)
    return path


# ---- interleaved repeats and their statistics -------------------------------------------------
def interleaved(configs: Mapping[str, Callable[[int], dict[str, Any]]], repeats: int, rotate: bool = True,
                label: str = "") -> dict[str, list[dict[str, Any]]]:
    """Every configuration once per round, `repeats` rounds: `configs[name](round)` returns one run's
    figures, which get their `round` and (unless they have it) the call's `wall_s`."""
    names = list(configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_number in range(repeats):
        shift = round_number % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            result = dict(configs[name](round_number))
            result.setdefault("wall_s", time.perf_counter() - begin)
            result["round"] = round_number
            runs[name].append(result)
            print(f"  {label}round {round_number + 1}/{repeats} {name}: {brief(result)}", flush=True)
    return runs


def brief(result: Mapping[str, Any]) -> str:
    """A run's scalar figures (one level of nesting too) as one short line."""
    return json.dumps(_scalars(result))[:300]


def _scalars(result: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    shown: dict[str, Any] = {}
    for key, value in result.items():
        if isinstance(value, float):
            shown[prefix + key] = round(value, 3)
        elif isinstance(value, int | str | bool) and key != "round":
            shown[prefix + key] = value
        elif isinstance(value, Mapping) and not prefix:
            shown.update(_scalars(value, f"{key}."))
    return shown


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, quartiles, min and max of the values that are not None; `missing` counts the Nones."""
    xs = sorted(float(v) for v in values if v is not None)
    missing = len(values) - len(xs)
    if not xs:
        return {"median": None, "q1": None, "q3": None, "min": None, "max": None, "n": 0, "missing": missing}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1], "n": len(xs),
            "missing": missing}


def field_spreads(runs: Mapping[str, list[Mapping[str, Any]]], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per configuration, per field: the spread over its runs."""
    return {name: {f: spread([r.get(f) for r in rs]) for f in fields} for name, rs in runs.items()}


def paired(runs: Mapping[str, list[Mapping[str, Any]]], a: str, b: str, field: str) -> dict[str, Any]:
    """Spread of per-round ratios runs[a][i][field] / runs[b][i][field]."""
    ratios = [x[field] / y[field] for x, y in zip(runs[a], runs[b], strict=True)
              if x.get(field) is not None and y.get(field)]
    return spread(ratios)


# ---- showing them ------------------------------------------------------------------------------
def cell(s: Mapping[str, Any] | None, digits: int = 1, suffix: str = "") -> str:
    """'12.3 (11.9–12.8)': median, then min–max over the repeats; '; 1 of 2 none' when some had no value."""
    if not s:
        return "–"
    missing = f"{s['missing']} of {s['n'] + s['missing']} none" if s.get("missing") else ""
    if s.get("median") is None:
        return missing or "–"
    text = f"{s['median']:.{digits}f}{suffix}"
    if s["n"] > 1:
        text += f" ({s['min']:.{digits}f}–{s['max']:.{digits}f})"
    return f"{text}; {missing}" if missing else text


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def dot_plot(groups: Mapping[str, Mapping[str, Sequence[float]]], title: str, ylabel: str, path: Path) -> Path:
    """One panel per group; in it every run of every configuration as a dot, the median as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(max(4.5 * len(groups), 6), 4.2), squeeze=False)
    for ax, (group, series) in zip(axes[0], groups.items(), strict=True):
        for x, values in enumerate(series.values()):
            values = [v for v in values if v is not None]
            ax.scatter([x] * len(values), values, s=18, alpha=0.7)
            if values:
                ax.hlines(statistics.median(values), x - 0.3, x + 0.3, color="black", lw=2)
        ax.set_xticks(range(len(series)), list(series), rotation=30, ha="right", fontsize=8)
        ax.set_title(group, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
