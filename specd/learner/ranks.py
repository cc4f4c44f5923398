"""Data-parallel learner ranks on torch.distributed (gloo on CPU, NCCL on GPUs), launched by torchrun.

Contract:
- `RankInfo.from_env()` reads what torchrun gives each worker (RANK, WORLD_SIZE, LOCAL_RANK,
  TORCHELASTIC_RESTART_COUNT); None outside torchrun. `RankGroup(info)` joins the process group
  (`init_process_group`, with a timeout after which a collective with a dead peer fails instead
  of hanging) and pins the rank to its share of the machine's cores.
- Each rank takes its own records (an MQTT shared subscription gives every record to exactly one
  rank), recomputes their features and trains on them; `specd.learner.trainer` averages the
  gradients with DistributedDataParallel, so one optimiser step sees every rank's batch.
- Every rank calls the collectives in the same order each learner tick: `all_ready` (a step
  happens only when every rank has records to train on), then the training step, then `sync`:
  the records each rank held out are gathered to rank 0, whose gate judges the whole traffic's
  evidence (the other ranks keep none), and when rank 0's trainer adopted other weights (a
  rollback, an operator's version) they are broadcast, so after every sync all ranks hold
  identical weights.
- Rank 0 alone runs the gate and the canary, publishes versions and serves the HTTP API; the
  store numbers versions under its lock, so a second publisher could never take a number twice.
- A rank whose step fails leaves the collectives: it exits (`RANK_FAILURE_EXIT`), torchrun's
  elastic agent restarts the group, and each rank resumes from the store's live version and its
  own spool (records are acknowledged only once spooled, per rank).
- `write_status` leaves each rank's figures (steps, records received and trained, a digest of its
  weights at a step every rank reaches) in `<store>/ranks/rank-N.json`, written at syncs and every
  `RANK_STATUS_S`, which rank 0's status shows with each file's age: a rank stopped or hung
  (`stalled`) shows there, while the others wait at a collective for up to `COLLECTIVE_TIMEOUT_S`
  before the group restarts.
- A rank stops (as SIGTERM stops it) when the process that launched it is gone: a launcher killed
  outright leaves no rank behind holding the store.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specd.core.errors import SpecdError
from specd.core.files import write_text_atomic
from specd.core.records import TrajectoryRecord

log = logging.getLogger(__name__)

RANK_FAILURE_EXIT = 75              # a rank that cannot go on: torchrun restarts the group
COLLECTIVE_TIMEOUT_S = 300.0        # a peer that died mid-collective is noticed within this
RANK_STATUS_S = 5.0                 # each rank's status file is written this often besides its syncs
RANK_STALL_S = 30.0                 # a status file older than this: its rank's process is not running


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    restart: int = 0                # how many times torchrun restarted the group

    @classmethod
    def from_env(cls) -> RankInfo | None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def rank_cores(local_rank: int, local_world: int, available: list[int], per_rank: int | None = None) -> list[int]:
    """This rank's share of the cores: an equal slice each (or `per_rank`), every rank at least one."""
    per_rank = per_rank or max(len(available) // max(local_world, 1), 1)
    begin = (local_rank * per_rank) % len(available)
    return available[begin:begin + per_rank] or available[:1]


class RankGroup:
    def __init__(self, info: RankInfo, backend: str = "gloo", pin_cores: bool = True,
                 cores_per_rank: int | None = None, status_folder: str | Path | None = None,
                 status_every: int = 50, watch_parent: bool = True) -> None:
        self.info = info
        self.status_folder, self.status_every = status_folder, max(status_every, 1)
        self.syncs = 0                    # the same count on every rank
        self.figures: dict[str, Any] = {}  # what this rank's status file shows besides the sync figures
        self._report_lock = threading.Lock()
        if pin_cores and hasattr(os, "sched_setaffinity"):
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
            cores = rank_cores(info.local_rank, local_world, sorted(os.sched_getaffinity(0)), cores_per_rank)
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            dist.init_process_group(backend, store=_store_of(info, timeout), rank=info.rank,
                                    world_size=info.world_size, timeout=timeout)
        self._weights_epoch = 0           # rank 0's adoptions seen, the same count on every rank
        if watch_parent:
            _stop_with_parent(info.rank)

    @property
    def is_root(self) -> bool:
        return self.info.is_root

    def all_ready(self, ready: bool) -> bool:
        """True on every rank when every rank is ready (a collective: every rank must call it)."""
        flag = torch.tensor([1 if ready else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def sync(self, held_out: list[TrajectoryRecord], weights_epoch: int, model: torch.nn.Module,
             stats: Any = None, adopted: Callable[[], None] | None = None) -> list[TrajectoryRecord]:
        """After a step: every rank's newly held-out records to rank 0 (returned there, [] elsewhere),
        and rank 0's weights to every rank when its trainer adopted others (or, anchored to live
        versions, made one of its own live) since the last sync (then `adopted` runs on every rank:
        the trainer's anchor follows the weights). Every
        `status_every` syncs each rank writes its status with a digest of its weights."""
        gathered: list[Any] | None = [None] * self.info.world_size if self.is_root else None
        dist.gather_object(held_out, gathered, dst=0)
        epoch = [weights_epoch]
        dist.broadcast_object_list(epoch, src=0)
        if epoch[0] != self._weights_epoch:
            self._weights_epoch = epoch[0]
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
            if adopted is not None:
                adopted()
        self.syncs += 1
        if self.syncs % self.status_every == 0:
            self.report(model, stats)
        if gathered is None:
            return []
        return [record for part in gathered for record in (part or [])]

    def report(self, model: torch.nn.Module | None = None, stats: Any = None, **figures: Any) -> None:
        """Write this rank's status (when it has a folder): its figures (kept: a later report without
        them repeats the last), and at a sync its weights' digest. From the learner's thread at syncs
        and from the sidecar's loop every `RANK_STATUS_S` (so a rank that hangs shows by its age)."""
        with self._report_lock:
            self.figures.update(figures, syncs=self.syncs)
            if model is not None:
                self.figures.update(digest=weights_digest(model), digest_at_sync=self.syncs)
            if stats is not None:
                self.figures.update(steps=stats.steps, tokens_trained=stats.tokens_trained,
                                    records_trained=stats.records_trained)
            if self.status_folder is not None:
                write_status(self.status_folder, self.info, self.figures)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _parent_gone(parent: int) -> bool:
    if os.getppid() != parent:
        return True  # adopted by init or a subreaper
    try:  # a killed parent no one has reaped yet is a zombie, which kill(pid, 0) still finds
        state = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no such process (where /proc exists), or a system without /proc
        return Path("/proc/self").exists() or not _pid_exists(parent)
    return state in ("Z", "X")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_with_parent(rank: int, poll_s: float = 1.0, grace_s: float = 30.0) -> None:
    """A rank whose launcher was killed outright (kill -9 reaches no child) stops as SIGTERM stops it,
    and exits regardless after `grace_s`; otherwise it would hold its store and port for good."""
    parent = os.getppid()

    def watch() -> None:
        while not _parent_gone(parent):
            time.sleep(poll_s)
        log.warning("rank %d: its launcher (pid %d) is gone; stopping", rank, parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(RANK_FAILURE_EXIT)

    threading.Thread(target=watch, name="specd-parent-watch", daemon=True).start()


def launch_ranks(ranks: int, max_restarts: int) -> int:
    """Run torchrun's elastic agent in this process: it starts this process's own command line
    once per rank (one machine) and restarts the whole group up to `max_restarts` times when a
    rank dies. Returns 0 when stopped by SIGTERM or SIGINT (which reach every rank)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each rank then sets its threads from its cores
    arguments = get_args_parser().parse_args(
        ["--standalone", "--nnodes", "1", "--nproc-per-node", str(ranks), "--max-restarts", str(max_restarts),
         "-m", "specd.cli.main", *sys.argv[1:]])
    try:
        run(arguments)
    except SignalException:
        return 0
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        tries = max_restarts + 1
        # torchrun's message is its advice on tracebacks unless the rank died of a signal
        cause = (failure.message if failure.message and not failure.message.startswith("To enable traceback")
                 else f"exit code {failure.exitcode}")
        raise SpecdError(f"the learner ranks failed {tries} time{'s' if tries > 1 else ''}; the last failure: "
                         f"rank {rank}, {cause} (its error is logged above)") from None
    return 0


@contextlib.contextmanager
def leave_group_on_failure(group: RankGroup | None) -> Iterator[None]:
    """Around a rank's learner tick: a failure mid-collective leaves the group out of step for
    good, so the rank exits and torchrun's agent restarts the group (alone, a learner retries)."""
    if group is None:
        yield
        return
    try:
        yield
    except Exception as error:
        if isinstance(error, dist.DistError) or "gloo" in str(error).lower():
            # a peer that died or hung: expected now and then, and its traceback says nothing more
            first = (str(error).splitlines() or [""])[0].split(". ")[0]  # gloo's first sentence names the cause
            log.error("rank %d: a collective failed (%s: %s); leaving the group for torchrun to restart it",
                      group.info.rank, type(error).__name__, first[:300])
        else:
            log.exception("rank %d failed a step; leaving the group for torchrun to restart it", group.info.rank)
        logging.shutdown()
        os._exit(RANK_FAILURE_EXIT)


def _store_of(info: RankInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store (torchrun's agent hosts it at MASTER_ADDR:MASTER_PORT, or rank 0 does),
    under a prefix of this incarnation of the group: after a restart, the ranks must not read the
    addresses the killed incarnation left there."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, info.world_size, is_master=info.is_root and not hosted_by_agent,
                          timeout=timeout)
    return dist.PrefixStore(f"specd-incarnation-{info.restart}", store)


def weights_digest(model: torch.nn.Module) -> str:
    """A short digest of a model's weights: equal on two ranks exactly when their weights are."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def status_path(store: str | Path, rank: int) -> Path:
    return Path(store) / "ranks" / f"rank-{rank}.json"


def write_status(store: str | Path, info: RankInfo, figures: dict[str, Any]) -> None:
    """This rank's figures, replaced atomically (a reader never sees half a file)."""
    path = status_path(store, info.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**asdict(info), "pid": os.getpid(), "time": time.time(), **figures}
    write_text_atomic(path, json.dumps(body))


def read_statuses(store: str | Path) -> list[dict[str, Any]]:
    """Every rank's last figures, by rank (a file being replaced or unreadable is left out), each with
    `age_s`, the seconds since it was written, and `stalled` when that is past `RANK_STALL_S`."""
    found = []
    now = time.time()
    for path in sorted((Path(store) / "ranks").glob("rank-*.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        age = round(now - float(status.get("time", now)), 1)
        found.append({**status, "age_s": age, "stalled": age > RANK_STALL_S})
    return sorted(found, key=lambda s: s.get("rank", 0))


def group_status(store: str | Path) -> dict[str, Any]:
    """What rank 0's status adds (the rest is its own): every rank's figures, their sums, the ranks stalled."""
    ranks = read_statuses(store)
    return {"ranks": ranks,
            # steps are taken together (one step is every rank's), so they are not summed
            "ranks_total": {key: sum(int(r.get(key) or 0) for r in ranks) for key in ("records_in", "tokens_trained")},
            "ranks_stalled": [r["rank"] for r in ranks if r["stalled"]]}
