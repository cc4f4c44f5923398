"""specd inside vLLM, on two routes, one folder each: `eagle3` (vLLM's own EAGLE-3 proposer serving
the exported feature drafter, with `eagle3.plugin` attaching `eagle3.companion.Eagle3Companion`
for records and in-place swaps) and `custom` (the `custom_class` proposer). `shared` holds what
both use: the worker-side loop, telemetry, slot and step tracking, the draft policy, the worker
extension and the launch command.

Import `specd.serving.vllm.custom.proposer.SpecdProposer` by dotted path (vLLM does); apart from
the plugin's `register`, nothing here imports vLLM itself, so the bookkeeping is tested without it.
"""
