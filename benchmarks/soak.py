"""The soak: the whole service under mixed traffic while a fault schedule hits it; is anything lost?

Two `specd serve` processes, a `specd learner` sidecar and Mosquitto on loopback; several
concurrent clients send chat and code requests (greedy and sampled, streamed and not, some
disconnecting early, some malformed) for `--minutes`, while the schedule (fractions of the run)
  0.15  restarts the broker                      0.55  publishes a worse version (the gate must refuse it)
  0.30  kills the learner (SIGKILL), restarts it 0.65  an operator rolls back by hand
  0.45  publishes a corrupt version (refused)    0.75  floods server 2 past its queue bound
Then it drains (every record a server had acknowledged by the broker must reach the learner) and
reports: requests sent / succeeded / refused with 429 / failed (goal 0 outside the flood's 429s),
greedy answers equal to the target's alone (goal: all), broker-acknowledged records against
records the learner received (goal: none lost), corrupt or worse versions that went live or
served (goal 0), and every process's resident memory over time (goal: flat after warm-up, in the
processes `--memory-judged` names: all four by default).

    python benchmarks/soak.py                  # about two minutes (CI runs this, see tests/test_soak.py)
    python benchmarks/soak.py --minutes 30     # the long soak
The target defaults to a small random Llama with SmolLM2's tokenizer (`--target tiny`), so that
four processes and the clients fit on two cores; `--target bundled` soaks SmolLM2-135M itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from common import markdown_table, parser, write_result
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

    await asyncio.gather(faults.run(seconds, tally, flood_server_2, args.flood_seconds), *clients)


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
        ["refused with 429 (outside the flood)", r["refused_429_outside_flood"], "0"],
        ["malformed, answered 4xx", r["malformed_answered_4xx"], ""],
        ["disconnected early by the client", r["disconnected_early"], ""],
        ["failed", r["failed"], "0"],
        ["greedy answers equal to the target's alone", f"{r['greedy_equal']} / {r['greedy_checked']}", "all"],
        ["records acknowledged by the broker", records["records_acked"], ""],
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
            "memory_flat": all(m["growth_pct"] <= result["memory_growth_limit_pct"]
                               for name, m in result["memory"].items() if name in result["memory_judged"])}


def main() -> int:
    p = parser(__doc__, "out/soak.json", repeats=1)
    p.add_argument("--minutes", type=float, default=2.0, help="traffic time, faults included (default 2)")
    p.add_argument("--target", default="tiny", help="tiny (default), bundled, or a checkpoint folder")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=16, help="greedy prompts, and as many sampled (default 16)")
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
    judged = [name for name in args.memory_judged.split(",") if name]
    if not judged or set(judged) - set(PROCESSES):
        p.error(f"--memory-judged names some of {', '.join(PROCESSES)}, got {args.memory_judged!r}")
    work = Path(args.work or tempfile.mkdtemp(prefix="specd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    target = (tiny_checkpoint(work / "tiny") if args.target == "tiny"
              else bundled_target_dir() if args.target == "bundled" else Path(args.target))
    greedy, sampled = traffic(args.prompts * 2, args.seed)
    print(f"soak: {len(greedy)} greedy prompts (target-only answers computed here), {len(sampled)} sampled; "
          f"work folder {work}", flush=True)
    loaded = LoadedTarget.load(target)
    greedy = expected_answers(loaded, greedy, args.max_tokens)
    broker = Broker(work / "broker").start()
    learner, *servers = soak_processes(work, target, broker, args.max_queued)
    memory = MemoryWatch({"broker": lambda: broker.process, "learner": lambda: learner.process,
                          "server-1": lambda: servers[0].process, "server-2": lambda: servers[1].process})
    faults = Faults(work, broker, learner, servers, TOKEN, loaded)
    tally = Tally()
    try:
        for process in (learner, *servers):
            process.start()
        memory.start()
        begin = time.monotonic()
        asyncio.run(drive(args, [s.url for s in servers], greedy, sampled, faults, tally))
        records = drain(learner, servers, timeout=120)
        versions = faults.version_outcomes()
    finally:
        memory.stop()
        for process in (*servers, learner):
            process.stop()
        broker.stop()
    result = {"minutes": args.minutes, "traffic_seconds": time.monotonic() - begin, "requests": tally.summary(),
              "records": records, "versions": versions, "memory": memory.summary(warmup_share=0.25),
              "memory_growth_limit_pct": args.memory_growth_limit, "memory_judged": judged,
              "fault_log": faults.log, "work": str(work),
              "operator_actions": faults.operator, "operator_latency": faults.operator_latency(),
              "learner_parts": faults.learner_parts}
    result["goals"] = goals_met(result)
    # issue 22's latency goals, reported beside the correctness goals (they do not set the exit status)
    latency = result["operator_latency"]
    result["latency_goals"] = {"verdict_p99_within_5_s": latency.get("gate verdict", {}).get("p99_s", 1e9) <= 5.0,
                               "rollback_within_1_s": latency.get("rollback", {}).get("max_s", 1e9) <= 1.0}
    text = report(result)
    print(text)
    print("goals:", json.dumps(result["goals"]), "latency goals:", json.dumps(result["latency_goals"]))
    write_result(args.out, args, result)
    Path(args.out).with_suffix(".md").write_text(text)
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
