"""The soak's fault schedule, the versions it plants, and the memory watch.

Contract: `Faults.run(seconds, tally, flood)` performs the schedule in soak.py's docstring at its
fractions of the run, logging each event with its time (`log`), and watches which drafter
version every server serves (twice a second) and which version is live at the learner.
The corrupt version is a copy of the live one whose weights no longer match their sha256; the
worse version is a copy with its weights drowned in noise; an operator tries to make each live
(`POST /v1/live`), which must refuse both (the corrupt one by its checksum, the worse one by
the gate; while the gate lacks evidence it answers 503, and the operator tries again every
`RETRY_AFTER_503_S` until it answers otherwise). After the first worse version, another worse
one is planted and submitted every `probe_every_s` (each must be refused), so that the
operator's verdict latency is sampled all through the run. Every operator action (each POST,
its answer and its seconds) is in `operator`; `operator_latency()` summarises them. The learner's
memory breakdown (`/v1/status`) is sampled every `parts_every_s` into `learner_parts`.
`version_outcomes()` says whether a planted version went live or was served anyway.
`MemoryWatch` samples each process's resident memory every two seconds; its summary compares
the last instance of each process, once it has run for the warm-up share of the soak since its
own start (a learner restarted mid-run is judged after its ramp), with its end; `instances` says
how many processes the name had (more than one: it was restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from soak_traffic import Tally

from specd.core.errors import VersionNotFound
from specd.drafter.checkpoint import load_drafter
from specd.hotswap.store import WeightStore
from specd.model.target import LoadedTarget
from specd.testing.processes import Broker, SpecdProcess, get_json

SCHEDULE = [(0.15, "restart the broker"), (0.30, "kill and restart the learner"),
            (0.45, "publish a corrupt version"), (0.55, "publish a worse version"),
            (0.65, "roll back by hand"), (0.75, "flood server 2")]


NOTE_CHARS = 240
RETRY_AFTER_503_S = 2.0  # an operator's wait before asking again for a verdict the gate could not give yet


def post(url: str, body: dict[str, Any], token: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=330) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


class Faults:
    def __init__(self, work: Path, broker: Broker, learner: SpecdProcess, servers: list[SpecdProcess], token: str,
                 target: LoadedTarget) -> None:
        self.work, self.broker, self.learner, self.servers, self.token = work, broker, learner, servers, token
        self.target = target
        self.log: list[dict[str, Any]] = []
        self.planted: dict[str, int] = {}
        self.first_answers: dict[str, int] = {}  # kind -> the status an operator got for the first of it
        self.served: set[int] = set()
        self.live_seen: set[int] = set()
        self._begin = time.monotonic()
        self._stop = threading.Event()
        self._pending: list[threading.Thread] = []
        self.operator: list[dict[str, Any]] = []
        self.probes: list[int] = []        # the worse versions planted after the first
        self.probe_every_s = 30.0
        self.learner_parts: list[dict[str, Any]] = []   # the learner's /v1/status memory over time
        self.parts_every_s = 15.0

    def note(self, event: str) -> None:
        shown = event if len(event) <= NOTE_CHARS else event[:NOTE_CHARS] + " ..."  # the log keeps it whole
        print(f"[soak {time.monotonic() - self._begin:6.1f} s] {shown}", flush=True)
        self.log.append({"at": time.monotonic() - self._begin, "event": event})

    # ---- the schedule ---------------------------------------------------------------------
    async def run(self, seconds: float, tally: Tally, flood: Callable[[], Awaitable[None]],
                  flood_seconds: float) -> None:
        watcher = threading.Thread(target=self._watch_versions, daemon=True)
        watcher.start()
        self._begin = time.monotonic() - tally.now()
        try:
            for share, event in SCHEDULE:
                await asyncio.sleep(max(0.0, share * seconds - tally.now()))
                self.note(event)
                if event.startswith("flood"):
                    tally.flood_window = (tally.now(), tally.now() + flood_seconds)
                    await flood()
                    # the flood's admitted requests still fill the queue: its 429s last until it drains
                    drained = await asyncio.to_thread(self._drain_queue, self.servers[1])
                    tally.flood_window = (tally.flood_window[0], tally.now())
                    self.note(f"flood over; server 2's queue {'drained' if drained else 'did not drain in 60 s'}")
                else:
                    await asyncio.to_thread(self._act, event)
        finally:
            await asyncio.sleep(max(0.0, seconds - tally.now()))
            self._stop.set()

    def _act(self, event: str) -> None:
        if event == "restart the broker":
            self.broker.stop()
            time.sleep(3)
            self.broker.start()
        elif event == "kill and restart the learner":
            self.learner.kill()
            time.sleep(3)
            self.learner.start()
            self.note("learner back")
        elif event.startswith("publish a"):  # the gate may take a while: the schedule goes on meanwhile
            kind = event.split()[2]
            thread = threading.Thread(target=self._plant, args=(kind,), name=f"soak-{kind}", daemon=True)
            thread.start()
            self._pending.append(thread)
        elif event == "roll back by hand":
            status, answer = self.operator_post("rollback", "/v1/rollback", {})
            self.note(f"rollback answered {status}: {answer}")

    def _plant(self, kind: str) -> None:
        """A new version in the learner's store, then an operator's attempt to make it live."""
        store = WeightStore(self.work / "learner-store")
        live = store.live_version()
        assert live is not None
        model = load_drafter(store.weights_path(live), self.target.fingerprint,
                             target_embedding=self.target.model.embed.weight)
        if kind == "worse":
            with torch.no_grad():
                for param in model.parameters():
                    if param.dtype.is_floating_point and param is not getattr(model, "embed", None):
                        param.add_(torch.randn_like(param) * (3 * float(param.float().std()) + 1e-3))
        version = store.publish(model, self.target.fingerprint, live, {"planted_by": "soak", "kind": kind},
                                self.target.model.embed.weight)
        if kind == "corrupt":  # flip bytes in the tensor data: the file no longer matches its manifest's sha256
            path = store.weights_path(version)
            data = bytearray(path.read_bytes())
            for offset in range(len(data) - 64, len(data) - 32):
                data[offset] ^= 0xFF
            path.write_bytes(bytes(data))
        if kind == "worse" and "worse" in self.planted:
            self.probes.append(version)
        else:
            self.planted[kind] = version
        status, answer = self.operator_post(f"verdict on a {kind} version", "/v1/live", {"version": version})
        # 503: the gate has too few held-out records yet (a learner just restarted has few); an operator
        # tries again, as the answer says, and the goal reads the first verdict
        while status == 503 and not self._stop.wait(RETRY_AFTER_503_S):
            self.note(f"{kind} version {version}: POST /v1/live answered 503 ({answer}); trying again")
            status, answer = self.operator_post(f"verdict on a {kind} version", "/v1/live", {"version": version})
        self.first_answers.setdefault(kind, status)
        self.note(f"{kind} version {version}: POST /v1/live answered {status}: {answer}")
        if kind == "worse" and len(self.probes) == 0:  # the first: probes follow until the run ends
            while not self._stop.wait(self.probe_every_s):
                with contextlib.suppress(OSError, ValueError, KeyError, AssertionError):  # the learner may restart
                    self._plant("worse")

    def operator_post(self, action: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        begin = time.monotonic()
        try:
            status, answer = post(self.learner.url + path, body, self.token)
        except OSError as error:  # no answer at all: counted, with the time it took to fail
            status, answer = 0, {"error": str(error)}
        if action == "rollback":
            kind = "rollback"
        elif isinstance(answer.get("evaluation"), dict):  # the gate replayed it: a verdict
            kind = "gate verdict"
        else:  # refused before any replay: a bad checksum, or the gate still waiting for evidence
            kind = "answered without a verdict"
        self.operator.append({"action": action, "kind": kind, "status": status,
                              "seconds": time.monotonic() - begin, "at": begin - self._begin})
        return status, answer

    def operator_latency(self) -> dict[str, Any]:
        """Per kind of answer (a gate verdict, a rollback, an answer without a verdict): count,
        median, p99 and max seconds."""
        kinds: dict[str, list[float]] = {}
        for action in self.operator:
            kinds.setdefault(action["kind"], []).append(action["seconds"])
        return {kind: {"count": len(xs), "median_s": statistics.median(xs),
                       "p99_s": sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))], "max_s": max(xs)}
                for kind, xs in kinds.items()}

    @staticmethod
    def _drain_queue(server: SpecdProcess, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if int(server.health()["requests_queued"]) == 0:
                    return True
            time.sleep(0.2)
        return False

    # ---- what went live and what was served -------------------------------------------------
    def _watch_versions(self) -> None:
        last_parts = 0.0
        while not self._stop.wait(0.5):
            if time.monotonic() - last_parts >= self.parts_every_s:  # the learner's memory, part by part
                with contextlib.suppress(OSError, ValueError, KeyError):
                    parts = get_json(self.learner.url + "/v1/status")["memory"]
                    self.learner_parts.append({"at": time.monotonic() - self._begin, **parts})
                    last_parts = time.monotonic()
            for server in self.servers:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # a busy server answers next time
                    self.served.add(int(server.health()["drafter_version"]))
            try:
                live = get_json(self.learner.url + "/v1/versions")["live"]
                if live is not None:
                    self.live_seen.add(int(live))
            except (OSError, ValueError, KeyError):
                pass  # the learner is restarting

    def version_outcomes(self) -> dict[str, Any]:
        """Whether a planted version went live (seen live, or its manifest says it was ever live)
        or was served by a server (seen in /health while watching)."""
        for thread in self._pending:  # an operator's attempt still waiting for the gate's answer
            thread.join(timeout=360)
        store = WeightStore(self.work / "learner-store")
        outcome: dict[str, Any] = {"planted": self.planted, "served": sorted(self.served)}
        def went_live(version: int | None) -> bool:
            return version is not None and (version in self.live_seen or _ever_live(store, version))

        for kind in ("corrupt", "worse"):
            version = self.planted.get(kind)
            outcome[f"{kind}_live"] = int(went_live(version))
            outcome[f"{kind}_served"] = int(version in self.served)
        for version in self.probes:  # later worse versions: each must have been refused too
            outcome["worse_live"] += int(went_live(version))
            outcome["worse_served"] += int(version in self.served)
        outcome["probes"] = list(self.probes)
        outcome["first_answers"] = dict(self.first_answers)
        outcome["went_live_or_served"] = sorted(v for v in (*self.planted.values(), *self.probes)
                                                if went_live(v) or v in self.served)
        return outcome


def _ever_live(store: WeightStore, version: int) -> bool:
    """Its manifest says it was live once (collected since: it was not live lately, gc keeps those)."""
    try:
        return "live_since" in store.manifest(version)
    except VersionNotFound:
        return False


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MB (0 without a VmRSS line); None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0) / 1024


class MemoryWatch:
    """Resident memory of each named process (by whatever process object its getter returns now)."""

    def __init__(self, processes: dict[str, Callable[[], Any]], interval: float = 2.0) -> None:
        self.processes, self.interval = processes, interval
        self.samples: dict[str, list[tuple[float, int, float]]] = {name: [] for name in processes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._begin = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, getter in self.processes.items():
                process = getter()
                if process is None:
                    continue
                mb = rss_mb(process.pid)
                if mb is not None:
                    self.samples[name].append((time.monotonic() - self._begin, process.pid, mb))

    def summary(self, warmup_share: float) -> dict[str, dict[str, Any]]:
        out = {}
        for name, samples in self.samples.items():
            if not samples:
                continue
            last_pid = samples[-1][1]
            mine = [(t, mb) for t, pid, mb in samples if pid == last_pid]
            # a process warms up for the same share of the run after its own start: one restarted
            # mid-run (the learner) is judged after its ramp, not during it
            warm_from = mine[0][0] + warmup_share * (samples[-1][0] - samples[0][0])
            warm = [mb for t, mb in mine if t >= warm_from] or [mb for _, mb in mine[-3:]]
            start, end = statistics.median(warm[:3]), statistics.median(warm[-3:])
            out[name] = {"warm_mb": start, "end_mb": end, "max_mb": max(mb for _, mb in mine),
                         "growth_pct": 100 * (end - start) / start, "instances": len({pid for _, pid, _ in samples}),
                         "samples": len(mine), "series": [(round(t, 1), round(mb, 1)) for t, pid, mb in samples]}
        return out
