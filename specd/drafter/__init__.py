"""Drafters: the proposal interface, the token-level transformer drafter, replay, checkpoints."""
