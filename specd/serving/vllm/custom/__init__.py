"""The `custom` route: specd's token-level hybrid drafter as vLLM's `custom_class` proposer."""
