"""The operator's control plane, mounted by both processes (a server and the learner sidecar):
HTTP routes over the weight store (`plane`: versions, weights, live / rollback / pin, acceptance
series), the dashboard page, and the log of served acceptance (`acceptance`). Sits above
`specd.hotswap` (whose store it drives) and below both the learner and serving, which is why it
is a room of its own rather than part of either."""
