"""`specd demo`: run the main job (`specd.demo.deployment`) and print its table."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from specd.cli.service import add_drafter_flags, drafter_spec
from specd.core.arguments import at_least, fraction
from specd.core.errors import ConfigurationError
from specd.core.files import write_text_atomic
from specd.drafter.factory import DrafterSpec
from specd.model.target import LoadedTarget

log = logging.getLogger(__name__)


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="replay traffic with a shift: adaptive vs static vs no speculation")
    p.add_argument("--traffic", default=None, help="JSONL traffic file (default: ShareGPT then HumanEval)")
    p.add_argument("--requests", type=at_least(2), default=40,
                   help="requests to replay, at least one per domain (default 40)")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="output budget per request (default 64)")
    p.add_argument("--batch", type=at_least(1), default=1,
                   help="requests decoded together (default 1: one request at a time, where a verification pass "
                        "costs about 1.15 one-token passes on a CPU; at 4 a pass is compute-bound and drafting "
                        "pays less)")
    p.add_argument("-k", type=at_least(1), default=None,
                   help="fix k drafts per step (for drafter comparisons: accept length then measures the drafter); "
                        "default: the lookahead controller picks k per step, up to 4 (the faster setting here), "
                        "and context continuations may reach past it (--context-k)")
    p.add_argument("--round-size", type=at_least(1), default=4,
                   help="requests per mode per round: the modes take turns, round by round (default 4)")
    p.add_argument("--learner", choices=["process", "thread", "off"], default="process",
                   help="process: its own process on cores of its own where there are two or more (default); "
                        "thread: beside serving, on the same cores; off: no learning (adaptive = static)")
    p.add_argument("--duty-cycle", type=fraction, default=0.5,
                   help="a learner thread's share of wall time (default 0.5; a process trains all the time)")
    add_drafter_flags(p)
    p.add_argument("--adaptive-k", action="store_true", help="with -k N: let the controller pick k per step, up to N")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic draw and the learner (default 0)")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--json-out", default="out/demo.json",
                   help="the figures as JSON (default out/demo.json, under the current folder)")
    p.add_argument("--plot-out", default="out/demo.png",
                   help="the plot; its suffix picks the format (default out/demo.png, under the current folder)")
    p.add_argument("--store", default=None, help="weight store directory (default: a temporary one)")
    p.set_defaults(run=run_demo_command)


def demo_drafter_spec(args: argparse.Namespace) -> DrafterSpec:
    """The drafter the demo's modes run; a fixed -k means k drafts a step, continuations included,
    unless --context-k says otherwise."""
    spec = drafter_spec(args)
    return replace(spec, context_k=None) if args.k is not None and args.context_k is None else spec


def check_outputs(json_out: Path, plot_out: Path) -> None:
    """Refuse, before minutes of decoding, output paths the results could not be written to."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if plot_out.suffix.lstrip(".").lower() not in formats:
        raise ConfigurationError(f"--plot-out {plot_out}: the suffix picks the format, one of "
                                 f"{', '.join(sorted(formats))}")
    for flag, path in (("--json-out", json_out), ("--plot-out", plot_out)):
        if path.is_dir():
            raise ConfigurationError(f"{flag} {path} is a folder: give the file to write")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigurationError(f"{flag} {path}: cannot make its folder ({error.strerror})") from None


def run_demo_command(args: argparse.Namespace) -> int:
    from specd.core.provenance import provenance, state_at_start
    from specd.core.traffic import (
        DEMO_HELD_OUT,
        HUMANEVAL_PROBLEMS,
        default_held_out,
        default_shift_traffic,
        load_jsonl,
        tuned_on,
    )
    from specd.demo.deployment import DEMO_LEARNER, DemoConfig, check_new_store, run_demo
    from specd.demo.report import plot

    at_start, started = state_at_start(), time.time()  # the commit and tree the figures come from
    if args.adaptive_k and args.k is None:  # without -k the controller picks k anyway: the flag would say nothing
        raise ConfigurationError("--adaptive-k goes with -k N (the most drafts a step); without -k the "
                                 "controller already picks k per step")
    check_outputs(Path(args.json_out), Path(args.plot_out))
    if args.store:  # before the model loads (run_demo checks again, for callers other than this command)
        check_new_store(Path(args.store))
    if args.traffic:
        items, held_out = load_jsonl(args.traffic)[:args.requests], None
    else:
        most = 2 * (HUMANEVAL_PROBLEMS - DEMO_HELD_OUT)  # half the requests are HumanEval problems
        if args.requests > most:
            raise ConfigurationError(f"--requests {args.requests} serves more HumanEval problems than there are "
                                     f"besides the {DEMO_HELD_OUT} held out (at most {most})")
        items = default_shift_traffic(args.requests, args.seed)
        held_out = default_held_out(args.requests, args.seed)
        overlap = tuned_on(items + held_out)
        if overlap:  # said, not refused: a longer or reseeded demo is worth running, with this caveat
            log.warning("%d of this demo's HumanEval problems are among those the demo learner's settings were "
                        "chosen on (the default demo's are not): its learning figures are not held out from them",
                        len(overlap))
    loaded = LoadedTarget.load(args.target)
    k = args.k if args.k is not None else 4
    config = DemoConfig(max_tokens=args.max_tokens, max_batch=args.batch, k=k, seed=args.seed,
                        adaptive_lookahead=args.k is None or args.adaptive_k, drafter=demo_drafter_spec(args),
                        round_size=args.round_size, learner_process=args.learner == "process",
                        learning=args.learner != "off",
                        learner=replace(DEMO_LEARNER, duty_cycle=args.duty_cycle, k=k, seed=args.seed))
    result = run_demo(loaded, items, config, Path(args.store) if args.store else None, held_out=held_out)
    settings = {name: value for name, value in vars(args).items() if name != "run"}
    result = {"provenance": {**provenance(at_start, started, settings), "seconds": round(time.time() - started, 1)},
              **result}
    write_text_atomic(args.json_out, json.dumps(result, indent=2))  # a full disk leaves no truncated JSON
    plot(result, Path(args.plot_out))
    print_demo(result)
    print(f"wrote {args.json_out} and {args.plot_out}")
    return 0


def print_demo(result: dict[str, Any]) -> None:
    from specd.demo.deployment import MODES

    by_domain = result["rounds"]["by_domain"]
    print(f"\n{'mode':9} {'domain':10} {'requests':>8} {'accept len':>10} {'acceptance':>10} {'tok/s':>7} "
          f"{'tok/s per round: median (min-max)':>34}")
    for mode in MODES:
        for domain, row in result["summary"][mode].items():
            spread = by_domain[domain]["tokens_per_s"][mode]
            print(f"{mode:9} {domain:10} {row['requests']:8d} {row['accept_length']:10.2f} "
                  f"{row['acceptance_rate']:10.1%} {row['tokens_per_s']:7.1f} "
                  f"{spread['median']:17.1f} ({spread['min']:.1f}-{spread['max']:.1f})")
    print("\nper-round ratios, median (min-max):")
    for domain, figures in by_domain.items():
        cells = [f"{name} {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" for name, r in figures["ratios"].items()]
        print(f"  {domain} ({figures['rounds']} rounds): " + "; ".join(cells))
    learner, swaps = result["learner"], result["swaps"]
    print(f"\nlossless (greedy outputs equal to no speculation): {result['lossless']}")
    shifted = len(result["domains"]) > 1  # a single-domain --traffic has no shift to speak of
    print(f"static = version {result['static_version']}; {swaps['applied']} swaps; versions serving"
          f"{' after the shift' if shifted else ''}: {', '.join(str(v) for v in swaps['versions_live_after_shift'])}")
    print(f"learner ({learner['arrangement']}, cores {learner.get('cores')}): {learner['steps']} steps, "
          f"{learner['tokens_trained']} tokens trained, {len(learner['published'])} versions passed the gate, "
          f"{learner.get('rejected', 0)} rejected, {learner.get('cpu_seconds')} CPU s")
    # the gate's verdict beside each version: it judged on its own few held-out records, not the curve's
    verdicts = {v["version"]: v for v in [*learner.get("published", []), *learner.get("stats", {}).get("rejected", [])]}
    for point in result["adaptation"] or []:
        print(f"  version {point['version']:>3} ({point['status']}): after {point['records_after_shift']:>3} "
              f"records{' of the new domain' if shifted else ''}, held-out accept length {point['accept_length']:.2f}"
              f"{gate_figures(verdicts.get(point['version']))}")


def gate_figures(verdict: dict[str, Any] | None) -> str:
    """'; gate 2.17 against 2.29 on 7 held-out records' for a verdict with figures, '' otherwise."""
    if not verdict or not isinstance(verdict.get("candidate"), int | float):
        return ""
    reference = max(verdict.get("live") or 0.0, verdict.get("bar") or 0.0)
    return (f"; gate {verdict['candidate']:.2f} against {reference:.2f} on "
            f"{verdict.get('held_out_records', '?')} held-out records")
