"""The top layer's servers: the OpenAI-compatible API, its metrics, `specd serve` wiring and the
`specd learner` sidecar application. Nothing below imports from here."""
