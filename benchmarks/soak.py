"""The soak: the whole service under mixed traffic while a fault schedule hits it; is anything lost?

Two `specd serve` processes, a `specd learner` sidecar and Mosquitto on loopback; several
concurrent clients send chat and code requests (greedy and sampled, streamed and not, some
disconnecting early, some malformed) for `--minutes` (timed from when the services are up), while
the schedule (fractions of the run)
  0.15  restarts the broker                      0.55  publishes a worse version (the gate must refuse it),
  0.30  kills the learner (SIGKILL), restarts it       then another every 30 s until the end
  0.45  publishes a corrupt version (refused)    0.65  an operator rolls back by hand
                                                 0.75  floods server 2 past its queue bound
Then it drains (every record a server had acknowledged by the broker must reach the learner) and
reports: requests sent / succeeded / refused with 429 / failed (goal 0 outside the flood's 429s),
greedy answers equal to the target's alone (goal: all), broker-acknowledged records against
records the learner received (goal: none lost), corrupt or worse versions that went live or
served (goal 0; and the first of each must have been judged and refused, 409, or the run has not
tested it), and every process's resident memory over time (goal: flat after warm-up, in the
processes `--memory-judged` names: all four by default). The last line says which goals failed;
the exit status is 0 only when every goal is met.

    python benchmarks/soak.py                  # two minutes on SmolLM2 (CI runs one: tests/test_soak.py)
    python benchmarks/soak.py --minutes 45     # the long soak (docs/measurements.md)
The target defaults to the bundled SmolLM2-135M (`--target bundled`), what CI and every run on
record soaked. `--target tiny` (a small random Llama with SmolLM2's tokenizer) starts faster; its
drafters accept about 1.05 tokens a pass, so the gate judges there on a margin of about 0.004
(`Gate.margin_below`), and the soak's traffic says little about drafting (each process logs that
the shipped drafter does not fit that target and starts one from scratch: expected there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from common import markdown_table, parser, provenance, write_result
from soak_faults import Faults, MemoryWatch
from soak_traffic import Prompt, Tally, client_loop, flood

from specd.core.traffic import load_humaneval, load_sharegpt
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.bundled import bundled_target_dir
from specd.model.target import LoadedTarget
from specd.testing.processes import Broker, SpecdProcess, free_port, get_json, tiny_checkpoint, wait_for

TOKEN = "soak-token"
DEPLOYMENT = "soak"
MIN_MINUTES = 1.0         # the shortest run whose fault schedule has room for every fault
PROGRESS_EVERY_S = 30.0   # a line of traffic figures this often: a long soak is not silent between faults


def expected_answers(loaded: LoadedTarget, prompts: list[Prompt], max_tokens: int) -> list[Prompt]:
    """Each greedy prompt with the target's own greedy answer, decoded here without a drafter."""
    engine = Engine(loaded.model, None, EngineConfig(eos_token_ids=loaded.eos_token_ids))
    ids = [loaded.encode(p.text, chat=p.chat) for p in prompts]
    outputs = engine.generate(ids, SamplingParams(max_tokens=max_tokens))
    return [Prompt(p.text, p.chat, p.domain, loaded.decode(s.output_ids))
            for p, s in zip(prompts, outputs, strict=True)]


def traffic(count: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(greedy prompts, sampled prompts): half chat from ShareGPT, half code from HumanEval."""
    chat = [Prompt(item.messages[0][1], True, "chat") for item in load_sharegpt(count, seed) if item.messages]
    code = [Prompt(str(item.prompt), False, "code") for item in load_humaneval(count, seed)]
    half = count // 2
    return chat[:half] + code[:half], chat[half:] + code[half:]


def soak_processes(work: Path, target: Path, broker: Broker, max_queued: int) -> list[SpecdProcess]:
    """The learner sidecar and two servers (not started yet)."""
    learner = SpecdProcess(["learner", "--store", str(work / "learner-store"), "--broker", broker.url,
                            "--deployment", DEPLOYMENT, "--target", str(target), "--publish-every", "5",
                            "--holdout-every", "4", "--token", TOKEN], free_port(), work / "learner.log")
    servers = [SpecdProcess(["serve", "--target", str(target), "--broker", broker.url, "--deployment", DEPLOYMENT,
                             "--learner-url", learner.url, "--server-id", f"soak-{i}", "--model-name", "soak",
                             "--store", str(work / f"server-{i}-store"), "--batch", "4",
                             "--max-queued", str(max_queued)], free_port(), work / f"server-{i}.log")
               for i in (1, 2)]
    return [learner, *servers]


async def drive(args: Any, urls: list[str], greedy: list[Prompt], sampled: list[Prompt], faults: Faults,
                tally: Tally) -> None:
    seconds = args.minutes * 60
    clients = [client_loop(c, urls, greedy, sampled, args.max_tokens, seconds, tally, args.seed)
               for c in range(args.clients)]
    def flood_server_2() -> Awaitable[None]:
        return flood(urls[1], 1, sampled, args.max_tokens, args.flood_seconds, args.flood_width, tally)

    async def progress() -> None:  # a line every 30 s: a long soak is not silent between its faults
        while tally.now() < seconds - PROGRESS_EVERY_S:
            await asyncio.sleep(PROGRESS_EVERY_S)
            live = max(faults.live_seen, default=None)
            print(f"[soak {tally.now():6.1f} s] {tally.progress()}; live version {live}", flush=True)

    await asyncio.gather(faults.run(seconds, tally, flood_server_2, args.flood_seconds), progress(), *clients)


def drain(learner: SpecdProcess, servers: list[SpecdProcess], timeout: float) -> dict[str, Any]:
    """Wait until every record each server published is acknowledged and at the learner."""
    def settled() -> bool:
        health = [s.health() for s in servers]
        if any(h["records_delivered"] + h["records_shed"] < h["records_published"] for h in health):
            return False
        return int(get_json(learner.url + "/v1/status")["records_in"]) >= sum(h["records_delivered"] for h in health)

    with contextlib.suppress(TimeoutError):  # what did not arrive is reported as lost below
        wait_for(settled, timeout, interval=1.0, what="records to drain")
    health = [s.health() for s in servers]
    status = get_json(learner.url + "/v1/status")
    acked = sum(int(h["records_delivered"]) for h in health)
    return {"records_published": sum(int(h["records_published"]) for h in health), "records_acked": acked,
            "records_shed": sum(int(h["records_shed"]) for h in health),
            "records_at_learner": int(status["records_in"]),
            "records_lost": max(0, acked - int(status["records_in"])), "learner_status": status}


def report(result: dict[str, Any]) -> str:
    r, records, versions, memory = result["requests"], result["records"], result["versions"], result["memory"]
    rows = [
        ["requests sent", r["sent"], ""],
        ["succeeded", r["succeeded"], ""],
        ["refused with 429 (flood)", r["refused_429_flood"], ""],
        ["malformed, answered 4xx", r["malformed_answered_4xx"], ""],
        ["disconnected early by the client", r["disconnected_early"], ""],
        ["failed (the five rows above and this one add up to the requests sent)", r["failed"], "0"],
        ["of the failed: refused with 429 outside the flood", r["refused_429_outside_flood"], "0"],
        ["greedy answers equal to the target's alone", f"{r['greedy_equal']} / {r['greedy_checked']}", "all"],
        # a record for every request the engine finished decoding, also one whose client left after it
        ["records acknowledged by the broker (one per request decoded to its end)", records["records_acked"], ""],
        ["records at the learner (trained on or held)", records["records_at_learner"], ""],
        ["records lost", records["records_lost"], "0"],
        ["corrupt / worse versions that went live", f"{versions['corrupt_live']} / {versions['worse_live']}", "0 / 0"],
        ["corrupt / worse versions served", f"{versions['corrupt_served']} / {versions['worse_served']}", "0 / 0"],
    ]
    table = markdown_table(["", "measured", "goal"], rows)
    mem_rows = [[name, f"{m['warm_mb']:.0f}", f"{m['end_mb']:.0f}", f"{m['max_mb']:.0f}", f"{m['growth_pct']:+.1f}%",
                 m["samples"], m["instances"]] for name, m in memory.items()]
    mem_table = markdown_table(["process", "RSS after warm-up (MB)", "RSS at end (MB)", "max (MB)",
                                "growth after warm-up", "samples", "instances"], mem_rows)
    latency_table = markdown_table(["operator action", "count", "median (s)", "p99 (s)", "max (s)", "goal"],
                                   [[kind, s["count"], f"{s['median_s']:.2f}", f"{s['p99_s']:.2f}", f"{s['max_s']:.2f}",
                                     {"gate verdict": "p99 <= 5 s", "rollback": "<= 1 s"}.get(kind, "")]
                                    for kind, s in result["operator_latency"].items()])
    faults = "\n".join(f"- {e['at']:.0f} s: {e['event']}" for e in result["fault_log"])
    return (f"{table}\n\n{mem_table}\n\n{parts_table(result)}\n\n{latency_table}\n\n"
            f"Fault schedule as it ran:\n{faults}\n")


def parts_table(result: dict[str, Any]) -> str:
    """The learner's memory by part (MB): after warm-up (the first sample past a quarter of the run,
    of the learner's last instance), at the end, and the largest seen."""
    samples = result["learner_parts"]
    if not samples:
        return "(no memory breakdown was sampled from the learner)"
    restarts = [e["at"] for e in result["fault_log"] if e["event"] == "learner back"]
    last_instance = [s for s in samples if s["at"] >= max(restarts, default=0.0)] or samples
    warm_at = last_instance[0]["at"] + 0.25 * (samples[-1]["at"] - last_instance[0]["at"])
    warm = next(s for s in last_instance if s["at"] >= warm_at)
    rows = []
    for part in [k for k in samples[-1] if k not in ("at", "backlog_records")]:
        values = [s.get(part) or 0 for s in last_instance]
        rows.append([part, f"{(warm.get(part) or 0) / 1e6:.1f}", f"{(samples[-1].get(part) or 0) / 1e6:.1f}",
                     f"{max(values) / 1e6:.1f}"])
    rows.append(["records waiting on the bus", warm.get("backlog_records"), samples[-1].get("backlog_records"),
                 max(s.get("backlog_records") or 0 for s in last_instance)])
    return markdown_table(["learner part", "after warm-up (MB)", "at end (MB)", "max (MB)"], rows)


# the processes whose resident memory is watched; the memory goal judges those named by --memory-judged
PROCESSES = ("broker", "learner", "server-1", "server-2")


def goals_met(result: dict[str, Any]) -> dict[str, bool]:
    r, v = result["requests"], result["versions"]
    return {"no_failed_requests": r["failed"] == 0,
            "greedy_all_equal": r["greedy_equal"] == r["greedy_checked"] > 0,
            "no_records_lost": result["records"]["records_lost"] == 0,
            "no_bad_version_live": v["corrupt_live"] + v["worse_live"] + v["corrupt_served"] + v["worse_served"] == 0,
            # a version answered 503 (the gate had too little evidence) or never planted was not tested
            "bad_versions_judged": all(v["first_answers"].get(kind) == 409 for kind in ("corrupt", "worse")),
            "memory_flat": all(m["growth_pct"] <= result["memory_growth_limit_pct"]
                               for name, m in result["memory"].items() if name in result["memory_judged"])}


def verdict(result: dict[str, Any]) -> str:
    """One line: every goal met, or which were not and what they measured."""
    failed = [name for name, met in result["goals"].items() if not met]
    if not failed:
        return f"soak: every goal met ({', '.join(result['goals'])})"
    v = result["versions"]
    growth = ", ".join(f"{name} {m['growth_pct']:+.1f}%" for name, m in result["memory"].items()
                       if name in result["memory_judged"])
    why = {"no_failed_requests": f"{result['requests']['failed']} failed requests",
           "greedy_all_equal": f"{result['requests']['greedy_equal']} / {result['requests']['greedy_checked']} "
                               f"greedy answers equal",
           "no_records_lost": f"{result['records']['records_lost']} records lost",
           "no_bad_version_live": f"bad versions live or served: {v['went_live_or_served']}",
           "bad_versions_judged": f"first answers to the planted versions: {v['first_answers']} (409 expected)",
           "memory_flat": f"growth {growth} (limit {result['memory_growth_limit_pct']:.0f}%)"}
    return "soak: goals NOT met: " + "; ".join(f"{name} ({why[name]})" for name in failed)


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Refuse what would fail only after minutes of soaking; the judged processes' names."""
    judged = [name for name in args.memory_judged.split(",") if name]
    if not judged or set(judged) - set(PROCESSES):
        p.error(f"--memory-judged names some of {', '.join(PROCESSES)}, got {args.memory_judged!r}")
    if not args.minutes >= MIN_MINUTES:
        p.error(f"--minutes must be at least {MIN_MINUTES} (the fault schedule needs room), got {args.minutes}")
    if args.target not in ("tiny", "bundled") and not (Path(args.target) / "config.json").is_file():
        p.error(f"--target is tiny, bundled or a checkpoint folder with a config.json, got {args.target!r}")
    if args.work is not None and Path(args.work).exists() and not Path(args.work).is_dir():
        p.error(f"--work {args.work} is a file, not a folder")
    out = Path(args.out)
    try:  # the result is written after the whole run: a path it cannot be written to is found now
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".soak-check-"):
            pass
    except OSError as error:
        p.error(f"--out {args.out}: cannot write there ({error.strerror or error})")
    return judged


def main() -> int:
    p = parser(__doc__, "out/soak.json", repeats=None)
    p.add_argument("--minutes", type=float, default=2.0,
                   help=f"traffic time from when the services are up, faults included (default 2, at least "
                        f"{MIN_MINUTES:g})")
    p.add_argument("--target", default="bundled", help="bundled (default), tiny, or a checkpoint folder")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=16,
                   help="greedy prompts per domain (chat, code), and as many sampled (default 16: 32 greedy)")
    p.add_argument("--max-queued", type=int, default=4, help="each server's queue bound (default 4)")
    p.add_argument("--flood-width", type=int, default=24, help="requests the flood keeps in flight")
    p.add_argument("--flood-seconds", type=float, default=6.0)
    p.add_argument("--memory-growth-limit", type=float, default=15.0,
                   help="RSS growth after warm-up, in percent, that still counts as flat (default 15)")
    p.add_argument("--memory-judged", default=",".join(PROCESSES),
                   help="the processes whose growth decides the memory goal (default all; every one is reported)")
    p.add_argument("--work", default=None, help="folder for stores and logs (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    judged = check_arguments(p, args)
    work = Path(args.work or tempfile.mkdtemp(prefix="specd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    target = (tiny_checkpoint(work / "tiny") if args.target == "tiny"
              else bundled_target_dir() if args.target == "bundled" else Path(args.target))
    greedy, sampled = traffic(args.prompts * 2, args.seed)
    print(f"soak: {len(greedy)} greedy prompts (target-only answers computed here), {len(sampled)} sampled; "
          f"work folder {work} (each process's log is there)", flush=True)
    loaded = LoadedTarget.load(target)
    greedy = expected_answers(loaded, greedy, args.max_tokens)
    result = run(args, work, target, loaded, greedy, sampled)
    result["memory_judged"] = judged
    result["goals"] = goals_met(result)
    # issue 22's latency goals, reported beside the correctness goals (they do not set the exit status)
    latency = result["operator_latency"]
    result["latency_goals"] = {"verdict_p99_within_5_s": latency.get("gate verdict", {}).get("p99_s", 1e9) <= 5.0,
                               "rollback_within_1_s": latency.get("rollback", {}).get("max_s", 1e9) <= 1.0}
    text = report(result)
    print(text)
    print("goals:", json.dumps(result["goals"]), "latency goals:", json.dumps(result["latency_goals"]))
    write_result(args.out, args, result)
    info = provenance(args)
    heading = (f"# Soak, {args.minutes:g} minutes, target {args.target}\n\ncommit {info['git_commit'][:12]}"
               f"{' (dirty)' if info['git_dirty'] else ''}, started {info['started_at']}, {info['cpu_model']}, "
               f"{args.clients} clients\n\n")
    goals = markdown_table(["goal", "met"], [[name, "yes" if met else "**no**"]
                                             for name, met in {**result["goals"], **result["latency_goals"]}.items()])
    Path(args.out).with_suffix(".md").write_text(f"{heading}{verdict(result)}\n\n{goals}\n\n{text}")
    print(verdict(result), flush=True)
    return 0 if all(result["goals"].values()) else 1


def run(args: argparse.Namespace, work: Path, target: Path, loaded: LoadedTarget, greedy: list[Prompt],
        sampled: list[Prompt]) -> dict[str, Any]:
    """The services up, the traffic and faults for `--minutes`, the drain; what was measured."""
    broker = Broker(work / "broker").start()
    learner, *servers = soak_processes(work, target, broker, args.max_queued)
    memory = MemoryWatch({"broker": lambda: broker.process, "learner": lambda: learner.process,
                          "server-1": lambda: servers[0].process, "server-2": lambda: servers[1].process})
    faults = Faults(work, broker, learner, servers, TOKEN, loaded)
    try:
        for process in (learner, *servers):
            process.start()
        memory.start()
        print(f"soak: services up; {args.minutes:g} minutes of traffic and faults from now", flush=True)
        tally = Tally()  # the schedule's fractions and the clients' deadline count from here
        asyncio.run(drive(args, [s.url for s in servers], greedy, sampled, faults, tally))
        traffic_seconds = tally.now()
        records = drain(learner, servers, timeout=120)
        versions = faults.version_outcomes()
    finally:
        memory.stop()
        for process in (*servers, learner):
            process.stop()
        broker.stop()
    return {"minutes": args.minutes, "traffic_seconds": traffic_seconds, "requests": tally.summary(),
            "records": records, "versions": versions, "memory": memory.summary(warmup_share=0.25),
            "memory_growth_limit_pct": args.memory_growth_limit,
            "fault_log": faults.log, "work": str(work),
            "operator_actions": faults.operator, "operator_latency": faults.operator_latency(),
            "learner_parts": faults.learner_parts}


if __name__ == "__main__":
    sys.exit(main())
