"""`SpecdWorkerExtension`: the manual control path into specd's proposer inside a running vLLM.

Contract: passed to vLLM as `--worker-extension-cls specd.serving.vllm.shared.extension.SpecdWorkerExtension`
(or `worker_extension_cls=` offline), its methods join vLLM's worker and are reached with
`llm.collective_rpc("specd_status")` offline or `POST /collective_rpc` (server started with
`VLLM_SERVER_DEV_MODE=1`) with `{"method": "specd_status"}`. They reach either route: specd's
`custom_class` proposer or the `eagle3` route's companion. Each returns plain JSON-able data, or
raises `RuntimeError` when the worker runs neither. Swaps never need this:
announcements drive them; this is for looking and for forcing a version by hand.
"""

from __future__ import annotations

from typing import Any

from specd.serving.vllm.custom.proposer import SpecdProposer
from specd.serving.vllm.eagle3.companion import Eagle3Companion


class SpecdWorkerExtension:
    def _specd_proposer(self) -> SpecdProposer | Eagle3Companion:
        """specd's part of this worker: its custom_class proposer, or the eagle3 route's companion."""
        proposer = getattr(getattr(self, "model_runner", None), "drafter", None)
        companion = getattr(proposer, "specd_companion", None)
        if isinstance(companion, Eagle3Companion):
            return companion
        if not isinstance(proposer, SpecdProposer):
            raise RuntimeError("this vLLM worker does not run specd (start it with `specd vllm`)")
        return proposer

    def specd_status(self) -> dict[str, Any]:
        """Version served, forced version, counters and acceptance totals per version."""
        return self._specd_proposer().status()

    def specd_force_version(self, version: int | str | None = None) -> dict[str, Any]:
        """Serve this version from now on, whatever is announced; None (or "", "none") follows them again.

        vLLM's HTTP route passes arguments as strings, so "3" means version 3.
        """
        given = version
        if isinstance(version, str):
            text = version.strip().lower()
            version = None if text in ("", "none", "null") else int(text) if text.isdigit() else -1
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise ValueError(f"version must be a non-negative integer or none, got {given!r}")
        return self._specd_proposer().force_version(version)

    def specd_hybrid(self, on: bool | str = True) -> dict[str, Any]:
        """eagle3 route: draft from context matches and the traffic table where they pay ("1"), or
        from EAGLE-3 alone ("0"), from the next step on. vLLM's HTTP route passes strings."""
        proposer = self._specd_proposer()
        if not isinstance(proposer, Eagle3Companion):
            raise RuntimeError("the custom route's drafter kind is chosen at start (SPECD_DRAFTER)")
        if isinstance(on, str):
            text = on.strip().lower()
            if text not in ("0", "1", "true", "false", "on", "off"):
                raise ValueError(f"on must be 1 or 0, got {on!r}")
            on = text in ("1", "true", "on")
        return proposer.set_hybrid(bool(on))

    def specd_recent_records(self, count: int = 64) -> list[dict[str, Any]]:
        """The last finished trajectory records (at most 64), newest last."""
        recent = list(self._specd_proposer().recent)
        return recent[len(recent) - max(0, min(int(count), len(recent))):]
