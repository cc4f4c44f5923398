"""Plain vLLM as the reference that every vLLM test module checks greedy outputs against.

Contract: `PROMPTS` (chat and code, asked `MAX_TOKENS` tokens each) and `VLLM_ARGS` (float32 and
eager, so that a server with specd's drafting computes the same greedy tokens as a plain one) are
shared by the vLLM test modules. conftest.py's session fixtures `plain_vllm` (plain vLLM serving
the bundled SmolLM2 with `VLLM_ARGS`) and `plain_vllm_tokens` (its greedy token ids per prompt)
start that server once for the whole run, not once per module: a vLLM start costs most of a minute.
"""

from __future__ import annotations

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.", "What is the capital of France?",
           "List three uses of a hash map.", "Explain what a drafter does in speculative decoding.",
           "Write a haiku about the sea.", "def add(a, b):\n    # add two numbers and return the sum"]
MAX_TOKENS = 48
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "1024",
             "--kv-cache-memory-bytes", str(2**30)]
