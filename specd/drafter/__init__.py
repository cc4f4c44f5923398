"""Drafters: the `Drafter` protocol, the token-level learned drafter, context matching, the traffic
table, the hybrid of them, checkpoints, and the factory servers build drafters with. Imports only
`specd.model` and `specd.core.errors` below it."""
