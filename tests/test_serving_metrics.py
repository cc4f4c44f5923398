"""The server's latency metrics count what a client waited for: the first token apart, and one
inter-token sample per token after it, however many tokens a decoding step emitted together.
(The HTTP-level checks of the same histograms are in test_api.py.)"""

from __future__ import annotations

import pytest

from specd.serving.http.metrics import ServingMetrics


def test_tokens_that_come_with_the_first_are_inter_token_samples_of_no_wait() -> None:
    metrics = ServingMetrics()
    metrics.observe_tokens(0.5, 3, first=True, streamed=True)    # drafts accepted in the prefill's step
    metrics.observe_tokens(0.3, 2, first=False, streamed=True)
    samples = {s.name: s.value for s in metrics.inter_token_latency.collect()[0].samples if "_bucket" not in s.name}
    # one sample per token after the first: 2 of 0 s, 2 of 0.15 s; the mean is (0.8 - 0.5) / (5 - 1)
    assert samples["specd_inter_token_latency_seconds_count"] == 4
    assert samples["specd_inter_token_latency_seconds_sum"] == pytest.approx(0.3)
    first = {s.name: s.value for s in metrics.time_to_first_token.collect()[0].samples}
    assert first["specd_time_to_first_token_seconds_count"] == 1
    assert first["specd_time_to_first_token_seconds_sum"] == pytest.approx(0.5)
