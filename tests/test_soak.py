"""The short soak in CI: benchmarks/soak.py for two minutes on SmolLM2, every correctness goal met.

Two `specd serve` processes, the learner sidecar and Mosquitto under mixed traffic while the fault
schedule restarts the broker, kills the learner, plants a corrupt and a worse version, rolls back
by hand and floods a server. Two minutes, not one: the learner killed at 30% of the run takes about
16 s to come back on a 2-core AVX2 machine and then ramps, so in a one-minute run its gate still
had 3 of the 4 held-out records it needs when the run ended, and the worse version was never judged
(two runs of 2026-12-07; the 2-minute run judged it 6 s after it was planted). Resident memory is
judged by the long soak (`--minutes 45`), whose tables docs/measurements.md quotes; a short run
only catches a leak in the servers gross enough to pass the loose bound here. The broker and the
learner are reported, not judged here. The broker holds 10-30 MB that swing with the messages it
queues through the flood (its samples in one 1-minute run: 8.5 to 28 MB), more than the bound in
percent. A learner restarted mid-run ramps for a minute or more as it loads and trains its first
batches (the 45-minute soaks: from about 0.9 GB to 3.0 GB over 70 s after its restart, flat after
that), so in a short run its "after warm-up" sample falls inside that ramp and its growth (23% to
55% in 2-minute runs of the same code) says nothing about a leak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_two_minutes_of_faults_lose_no_record_fail_no_request_and_serve_no_bad_version(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--minutes", "2", "--target",
                          "bundled", "--work", str(tmp_path / "work"), "--out", str(out),
                          "--memory-growth-limit", "40", "--memory-judged", "server-1,server-2"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    print(run.stdout[-6000:])
    assert out.is_file(), f"the soak wrote no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    requests, records, versions = result["requests"], result["records"], result["versions"]
    assert requests["failed"] == 0, requests["failures"]
    assert requests["refused_429_flood"] > 0  # the flood did pass the queue bound
    assert requests["greedy_checked"] > 20 and requests["greedy_equal"] == requests["greedy_checked"]
    assert records["records_acked"] > 20 and records["records_lost"] == 0
    assert versions["corrupt_live"] == versions["worse_live"] == 0
    assert versions["corrupt_served"] == versions["worse_served"] == 0
    assert set(versions["planted"]) == {"corrupt", "worse"}
    assert versions["first_answers"] == {"corrupt": 409, "worse": 409}  # each judged and refused, not left untested
    classes = ("succeeded", "refused_429_flood", "malformed_answered_4xx", "disconnected_early", "failed")
    assert sum(requests[name] for name in classes) == requests["sent"]
    # the broker and the learner are watched and reported but not judged here (see the module's docstring)
    assert result["memory_judged"] == ["server-1", "server-2"]
    assert set(result["memory"]) == {"broker", "learner", "server-1", "server-2"}, result["memory"].keys()
    judged = [result["memory"][name] for name in result["memory_judged"]]
    assert all(m["growth_pct"] <= result["memory_growth_limit_pct"] for m in judged), result["memory"]
    # the exit status is every goal's, the memory goal over the judged processes only
    assert run.returncode == 0, (result["goals"], run.stderr[-3000:])
