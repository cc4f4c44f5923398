"""specd inside vLLM (top layer): the `custom_class` proposer, its parts (slot and step tracking,
draft policy, telemetry), its worker extension and the launch command.

Import `specd.vllm.proposer.SpecdProposer` by dotted path (vLLM does); nothing here imports
vLLM itself, so the bookkeeping is tested without it.
"""
