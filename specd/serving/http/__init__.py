"""specd's own HTTP server: the OpenAI-compatible API (`api`), its request fields (`fields`),
incremental detokenisation (`detokenize`) and the serving metrics (`metrics`)."""
