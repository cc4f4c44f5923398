"""The bottom layer: what every other room shares. Errors (`errors`), what servers tell the learner
(`records`: trajectory records, acceptance counts and reports), supervised background threads
(`threads`, and their Prometheus view in `background_metrics`) and replayable traffic
(`traffic`: ShareGPT, HumanEval, JSONL). Imports nothing of specd."""
