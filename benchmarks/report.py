"""`python benchmarks/report.py`: run the benchmarks that fit in about 20 minutes here, write one report.

Contract: runs each benchmark as a process of its own (fresh memory; its JSON carries its own
provenance), one after another, with sizes chosen for a 2-core machine (`--quick`: a 3–5 minute
smoke version of the same), printing their output prefixed with the benchmark and elapsed time.
Then it reads their JSON results and writes OUT/report.md (default out/report.md): the
provenance, then per benchmark its command, duration and tables (each benchmark's own
`markdown(result, out)`, which also draws its PNG plots under OUT). Every figure is a median over
interleaved repeats with its min–max. A benchmark that fails is reported with the tail of its
output and the report is still written. Thread settings: OMP_NUM_THREADS and MKL_NUM_THREADS are
set to `--threads` (default 1) for every benchmark and the servers it starts; on a shared 2-core
machine a 2-thread torch pool stalls whenever a neighbour takes a core. The vLLM comparison
(`vllm_compare.py`, four vLLM servers at once) runs in a small form when vLLM is installed;
`--no-vllm` skips it. `--render-only` rewrites the report from the JSON already in OUT.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import markdown_table, provenance

HERE = Path(__file__).resolve().parent
TITLES = {"engine_speed": "Engine decode speed", "shift": "The shift: adaptive vs static vs none",
          "service_load": "The service under load", "negative_term": "The learner's negative term",
          "learning_curve": "Learning curves: accept length against data trained",
          "feature_cost": "The feature drafter's cost per draft token (c) and vocabulary coverage",
          "vllm_compare": "vLLM with and without drafters"}
SIZES: dict[str, dict[str, list[str]]] = {
    "full": {
        "engine_speed": ["--dtypes", "float32", "--batches", "1", "4", "--new-tokens", "64", "--repeats", "3"],
        "shift": ["--requests", "32", "--max-tokens", "64", "--repeats", "2"],
        "service_load": ["--seconds", "12", "--repeats", "3"],
        "negative_term": ["--requests", "32", "--steps", "40", "--every", "10", "--repeats", "2"],
        "learning_curve": [],  # its defaults: about 10 minutes
        "feature_cost": ["--repeats", "3"],
        "vllm_compare": ["--only", "plain,ngram,eagle3_static,specd_adaptive", "--requests", "8", "--warmup", "16",
                         "--max-tokens", "64", "--repeats", "2"],
    },
    "quick": {
        "engine_speed": ["--dtypes", "float32", "--batches", "1", "--new-tokens", "24", "--repeats", "2"],
        "shift": ["--requests", "8", "--max-tokens", "24", "--repeats", "2"],
        "service_load": ["--seconds", "5", "--repeats", "2", "--clients", "2"],
        "negative_term": ["--tiny", "--steps", "20", "--every", "10", "--repeats", "2"],
        "learning_curve": ["--quick"],
        "feature_cost": ["--repeats", "2", "--vocab", "8192,49152", "--prompts", "8", "--tokens", "32"],
        "vllm_compare": ["--only", "plain,eagle3_static,specd_adaptive", "--requests", "2", "--warmup", "4",
                         "--max-tokens", "32", "--repeats", "2", "--wait-for-version", "120"],
    },
}


def stream(name: str, argv: list[str], env: dict[str, str], log: Path) -> int:
    """Run one benchmark, echoing its lines (progress bars at most every 15 s) and keeping a log."""
    begin = last_bar = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
    assert process.stdout is not None
    pending = b""
    with log.open("wb") as handle:
        while chunk := os.read(process.stdout.fileno(), 65536):
            handle.write(chunk)
            pending += chunk
            *parts, pending = re.split(rb"(\r|\n)", pending)
            for text, end in zip(parts[0::2], parts[1::2], strict=True):
                line = text.decode(errors="replace").rstrip()
                now = time.monotonic()
                if not line or (end == b"\r" and now - last_bar < 15):
                    continue
                last_bar = now if end == b"\r" else last_bar
                elapsed = int(now - begin)
                print(f"[{name} {elapsed // 60:02d}:{elapsed % 60:02d}] {line}", flush=True)
    return process.wait()


def run_all(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "PYTHONUNBUFFERED": "1"}
    runs: dict[str, dict[str, Any]] = {}
    for number, name in enumerate(names, start=1):
        argv = [sys.executable, str(HERE / f"{name}.py"), *SIZES[args.size][name],
                "--out", str(args.out / f"{name}.json")]
        print(f"=== [{number}/{len(names)}] {name}: {' '.join(argv[1:])}", flush=True)
        begin = time.monotonic()
        code = stream(name, argv, env, args.out / f"{name}.log")
        seconds = time.monotonic() - begin
        runs[name] = {"argv": argv[1:], "exit_code": code, "seconds": seconds}
        print(f"=== {name} {'done' if code == 0 else f'FAILED (exit {code})'} in {seconds / 60:.1f} min", flush=True)
    return runs


def header(info: dict[str, Any], args: argparse.Namespace) -> str:
    threads = ", ".join(f"{k}={v}" for k, v in info["threads"].items()) or "–"
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    dirty = f"yes ({len(info['git_dirty_files'])} files)" if info["git_dirty"] else "no"
    rows = [["git commit", f"`{info['git_commit']}`"], ["uncommitted changes", dirty],
            ["Python, packages", f"{info['python']}; {versions}"],
            ["CPU", f"{info['cpu_model']} ({info['cpus_usable']} usable of {info['cpu_count']} cores)"],
            ["threads", threads], ["load average at start", str(info["load_average_at_start"])],
            ["size", args.size], ["started", info["started_at"]]]
    return markdown_table(["", ""], rows)


def section(name: str, run: dict[str, Any] | None, args: argparse.Namespace) -> str:
    text = f"## {TITLES[name]}\n\n"
    result_path = args.out / f"{name}.json"
    if run is not None:
        text += f"`python benchmarks/{' '.join(Path(a).name if a.endswith('.py') else a for a in run['argv'])}`"
        text += f" ({run['seconds'] / 60:.1f} min)\n\n"
        if run["exit_code"] != 0:
            tail = (args.out / f"{name}.log").read_text(errors="replace")[-1500:]
            return text + f"**Failed** (exit {run['exit_code']}); the end of its output:\n\n```\n{tail}\n```\n"
    if not result_path.is_file():
        return text + "No result.\n"
    result = json.loads(result_path.read_text())
    module = importlib.import_module(name)
    doc = (module.__doc__ or "").split("\n\n")[0].strip()
    info = result.get("provenance", {})
    text += f"{doc}\n\nCommit `{str(info.get('git_commit'))[:12]}`, dirty: {info.get('git_dirty')}, "
    threads = info.get("threads", {}).get("torch.get_num_threads")
    load = ", ".join(f"{x:.1f}" for x in info.get("load_average_at_start") or [])
    text += (f"torch threads: {threads}; started {info.get('started_at')}, load average {load}; "
             f"every setting in `{result_path.name}`.\n\n")
    return text + module.markdown(result, args.out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the 3–5 minute smoke version")
    p.add_argument("--out", type=Path, default=Path("out"), help="folder for the report, JSON and plots (default out)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every benchmark (default 1)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")
    p.add_argument("--only", default=None, help="run only these (comma-separated: " + ",".join(TITLES)
                   + "); the report keeps the others' earlier results")
    p.add_argument("--render-only", action="store_true", help="write the report from the JSON already in --out")
    args = p.parse_args()
    args.size = "quick" if args.quick else "full"
    args.out.mkdir(parents=True, exist_ok=True)
    with_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    names = [n for n in TITLES if (with_vllm or n != "vllm_compare")]
    begin = time.monotonic()
    saved = args.out / "report-runs.json"
    runs: dict[str, dict[str, Any]] = json.loads(saved.read_text()) if saved.is_file() else {}
    if not args.render_only:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # so that the provenance below says what ran
        chosen = [n for n in names if not args.only or n in args.only.split(",")]
        runs = {n: r for n, r in runs.items() if args.only and n not in chosen}  # --only: keep the others' runs
        runs.update(run_all(args, chosen))
        saved.write_text(json.dumps(runs, indent=2))
    names = [n for n in names if n in runs or (args.out / f"{n}.json").is_file()]
    parts = ["# specd benchmark report", header(provenance(args), args),
             "Each figure is the median over interleaved repeats, with min–max in parentheses; ratios are "
             "taken within a round (paired), then summarised."]
    parts += [section(name, runs.get(name), args) for name in names]
    if "vllm_compare" not in names:
        why = "--no-vllm" if args.no_vllm else "vLLM is not installed (bash scripts/setup --vllm)"
        parts.append(f"## {TITLES['vllm_compare']}\n\nNot run: {why}.")
    report = args.out / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    print(f"report: {report} ({(time.monotonic() - begin) / 60:.1f} min in all)", flush=True)


if __name__ == "__main__":
    main()
