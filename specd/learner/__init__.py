"""The online learner: record intake, buffer, training signal and losses, the training loop, the
evaluation gate and promotion; versions go out through `specd.hotswap.store`. Its process: the
child-process handle (`process`), the MQTT sidecar application (`sidecar`), the record spool
(`spool`), the learner's Prometheus collector (`collector`) and the supervised thread (`supervision`)."""
