"""specd inside vLLM (top layer), on two routes: `eagle3` (vLLM's own EAGLE-3 proposer serving the
exported feature drafter, with `plugin` attaching `eagle3.Eagle3Companion` for records and in-place
swaps) and `custom` (the `custom_class` proposer and its parts: slot and step tracking, draft
policy); the worker-side loop both share (`loop`, `telemetry`), the worker extension and the
launch command.

Import `specd.vllm.proposer.SpecdProposer` by dotted path (vLLM does); apart from the plugin's
`register`, nothing here imports vLLM itself, so the bookkeeping is tested without it.
"""
