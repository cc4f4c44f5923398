"""Learner: record intake, buffer, losses, training loop and evaluation gate (see issue 3)."""
