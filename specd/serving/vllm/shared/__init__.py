"""What both vLLM routes share: configuration and the vLLM command line (`launch`, `command`), the
worker extension (`extension`), the worker-side online loop (`worker_loop`, `telemetry`), row bookkeeping
(`tracking`) and which drafts are worth verifying (`budget`, `policy`)."""
