"""The top layer: what serves requests. `http` (the OpenAI-compatible API, its fields,
detokenisation, Prometheus metrics), `serve` (the wiring of `specd serve`: engine, swapper,
control plane, embedded learner), and `vllm` (specd inside vLLM: `shared` launch and worker loop,
the `eagle3` route, the `custom` route). Nothing below imports from here."""
