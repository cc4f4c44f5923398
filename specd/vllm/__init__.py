"""specd inside vLLM: the `custom_class` proposer, its worker extension and the launch command.

Import `specd.vllm.proposer.SpecdProposer` by dotted path (vLLM does); nothing here
imports vLLM itself, so the bookkeeping is tested without it.
"""
