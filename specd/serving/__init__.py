"""Serving: target models and loading, the speculative-decoding engine, sampling maths, the vLLM plugin."""
