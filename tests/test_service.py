"""The service end to end: Mosquitto, `specd learner`, `specd serve` processes, the openai client.

A small random Llama with SmolLM2's tokenizer stands in for the target so that three processes
fit on two cores; everything else (broker, processes, HTTP, MQTT, swaps) is the real thing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget
from specd.testing.processes import Broker, SpecdProcess, free_port, get_json, post_json, tiny_checkpoint, wait_for

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]

QUESTIONS = ["What is a drafter?", "Name a prime number.", "Say hello in French.", "Why do birds sing?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[str, str]:
    """Target-only greedy answers, decoded in this process."""
    loaded = LoadedTarget.load(checkpoint)
    engine = Engine(loaded.model, None, EngineConfig(eos_token_ids=loaded.eos_token_ids))
    prompts = [loaded.encode(q, chat=True) for q in QUESTIONS]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return {q: loaded.decode(s.output_ids) for q, s in zip(QUESTIONS, seqs, strict=True)}


@pytest.fixture
def broker(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    yield broker
    broker.stop()


def serve(tmp_path: Path, broker: Broker, deployment: str, checkpoint: Path, learner_url: str,
          name: str) -> SpecdProcess:
    args = ["serve", "--target", str(checkpoint), "--broker", broker.url, "--deployment", deployment,
            "--learner-url", learner_url, "--server-id", name, "--model-name", "tiny", "--store",
            str(tmp_path / f"{name}-store"), "--batch", "4"]
    return SpecdProcess(args, free_port(), tmp_path / f"{name}.log")


def start_learner(tmp_path: Path, broker: Broker, deployment: str, checkpoint: Path,
                  port: int | None = None) -> SpecdProcess:
    port = port or free_port()
    args = ["learner", "--store", str(tmp_path / "learner-store"), "--broker", broker.url, "--deployment", deployment,
            "--target", str(checkpoint), "--publish-every", "2", "--token", "secret",
            "--holdout-every", "2"]  # 8 records hold 4 out: enough evidence for the gate
    return SpecdProcess(args, port, tmp_path / f"learner-{port}.log").start()


def ask(server: SpecdProcess, question: str, stream: bool = False) -> str:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": question}]
    if not stream:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0)
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def post(url: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def publish_raw(broker: Broker, topic: str, payload: bytes) -> None:
    import aiomqtt

    async def send() -> None:
        async with aiomqtt.Client("127.0.0.1", broker.port) as client:
            await client.publish(topic, payload, qos=1)

    asyncio.run(send())


def test_two_servers_learn_swap_roll_back_and_stay_lossless(tmp_path, broker, checkpoint, expected) -> None:
    deployment = "e2e"
    brain = start_learner(tmp_path, broker, deployment, checkpoint)
    # day 0 stays the floor however many versions the learner publishes before the rollback (GC keeps pins)
    post_json(brain.url + "/v1/pin", {"version": 1, "pinned": True}, token="secret")
    servers = [serve(tmp_path, broker, deployment, checkpoint, brain.url, f"server-{i}").start() for i in (1, 2)]
    try:
        for round_number in range(2):
            for i, question in enumerate(QUESTIONS):
                server = servers[i % 2]
                assert ask(server, question, stream=bool((i + round_number) % 2)) == expected[question]
        sent = 2 * len(QUESTIONS)
        wait_for(lambda: get_json(brain.url + "/v1/status")["records_in"] >= sent, 60, what="records at the learner")
        # the learner publishes a trained version; both servers take it
        live = wait_for(lambda: (v := get_json(brain.url + "/v1/versions")["live"]) and v >= 2 and v, 120,
                        what="a published version")
        def on_live(server: SpecdProcess) -> bool:
            return server.health()["drafter_version"] == get_json(brain.url + "/v1/versions")["live"]

        for server in servers:
            wait_for(lambda s=server: on_live(s), 30, what="servers on the new version")
        for question in QUESTIONS:
            assert ask(servers[0], question) == expected[question]
        # an operator rolls back to day 0 with the CLI: both servers follow within seconds
        out = subprocess.run([sys.executable, "-m", "specd.cli.main", "rollback", "1", "--url", brain.url,
                              "--token", "secret"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        restored = get_json(brain.url + "/v1/versions")["live"]
        assert restored == 1 and live >= 2
        statuses = {m["version"]: m["status"] for m in get_json(brain.url + "/v1/versions")["versions"]}
        assert "rolled-back" in [status for version, status in statuses.items() if version >= live]
        for server in servers:
            wait_for(lambda s=server: s.health()["drafter_version"] == restored, 15, what="servers rolled back")
        for i, question in enumerate(QUESTIONS):
            assert ask(servers[i % 2], question, stream=True) == expected[question]
        # control operations need the token; malformed records are refused and counted
        assert post(brain.url + "/v1/rollback", {})[0] == 401
        assert post(brain.url + "/v1/live", {"version": restored}, token="wrong")[0] == 401
        before = get_json(brain.url + "/v1/status")["records_refused"]
        publish_raw(broker, f"specd/{deployment}/records/intruder", b"{not json")
        publish_raw(broker, f"specd/{deployment}/records/intruder", json.dumps({"schema_version": 99}).encode())
        wait_for(lambda: get_json(brain.url + "/v1/status")["records_refused"] >= before + 2, 30,
                 what="refused records counted")
        metrics = urllib.request.urlopen(servers[0].url + "/metrics", timeout=10).read().decode()
        assert "specd_drafter_swaps_total" in metrics and "specd_spec_decode_num_draft_tokens_total" in metrics
    finally:
        for server in servers:
            server.stop()
        brain.stop()


def test_broker_outage_learner_restart_and_late_server_lose_nothing(tmp_path, broker, checkpoint, expected) -> None:
    deployment = "faults"
    port = free_port()
    brain = start_learner(tmp_path, broker, deployment, checkpoint, port)
    server = serve(tmp_path, broker, deployment, checkpoint, brain.url, "server-a").start()
    late: SpecdProcess | None = None
    try:
        assert ask(server, QUESTIONS[0]) == expected[QUESTIONS[0]]
        # the broker goes away: requests keep succeeding, records wait in the server's buffer
        broker.stop()
        # once the server has noticed the outage, no acknowledgement can still arrive
        wait_for(lambda: server.health()["broker_connected"] is False, 30, what="the server noticing the outage")
        delivered_before_outage = server.health()["records_delivered"]
        for question in QUESTIONS:
            assert ask(server, question) == expected[question]
        # a record is published just after its answer is sent
        wait_for(lambda: server.health()["records_published"] == 1 + len(QUESTIONS), 10, what="records published")
        assert server.health()["records_delivered"] == delivered_before_outage  # nothing got through
        broker.start()
        wait_for(lambda: get_json(brain.url + "/v1/status")["records_in"] == 1 + len(QUESTIONS), 60,
                 what="records at the learner after the outage")
        # the learner dies: records published meanwhile reach its restarted self (persistent session)
        brain.kill()
        delivered_before_restart = server.health()["records_delivered"]
        for question in QUESTIONS:
            assert ask(server, question, stream=True) == expected[question]
        # delivered counts records only (acceptance reports are counted apart): exactly these
        wait_for(lambda: server.health()["records_delivered"] == delivered_before_restart + len(QUESTIONS), 60,
                 what="broker acks while the learner is down")
        brain = start_learner(tmp_path, broker, deployment, checkpoint, port)
        wait_for(lambda: get_json(brain.url + "/v1/status")["records_in"] == 1 + 2 * len(QUESTIONS), 60,
                 what="every acknowledged record at the restarted learner")
        # a server started after the announcement learns the live version from the retained message
        live = get_json(brain.url + "/v1/versions")["live"]
        late = serve(tmp_path, broker, deployment, checkpoint, brain.url, "server-late").start()
        wait_for(lambda: late.health()["drafter_version"] == get_json(brain.url + "/v1/versions")["live"], 30,
                 what="late server on the live version")
        assert live is not None
    finally:
        for process in (server, late, brain):
            if process is not None:
                process.stop()
