"""The learner: record intake, buffer, training signal and losses, the training loop and the
evaluation gate; versions go out through `specd.hotswap.store`. The MQTT sidecar application
that runs it lives in `specd.server.sidecar`."""
