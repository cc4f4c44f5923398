"""Real processes on loopback for the service tests and benchmarks: Mosquitto, `specd learner`,
`specd serve`, vLLM. Test support: it lives with the tests, not in the installed package.

Each helper starts a process, waits until it answers, and stops it on exit. Ports are free
ports chosen by the OS; every test gets its own MQTT deployment name (its own topics).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from dependencies import mosquitto_binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check, timeout: float = 60.0, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as error:  # not up yet
            last_error = error
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_error})")


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def terminate(process: subprocess.Popen | None, grace_seconds: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace_seconds`."""
    if process is None:
        return
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_seconds)
    if process.poll() is None:
        process.kill()
        process.wait(10)


class Broker:
    """Mosquitto on a free loopback port, with persistence so sessions survive a restart."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mosquitto.conf").write_text(
            # user root: as root, mosquitto would drop to a "mosquitto" user that cannot write here
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\nuser root\npersistence true\n"
            f"persistence_location {folder}/\nmax_queued_messages 100000\nautosave_interval 1\n")

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> Broker:
        binary = mosquitto_binary()
        if binary is None:
            raise FileNotFoundError("mosquitto is not installed; install it with `bash scripts/system-deps`")
        self.process = subprocess.Popen([binary, "-c", str(self.folder / "mosquitto.conf")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        wait_for(listening, 20, what="mosquitto")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


class SpecdProcess:
    """`python -m specd.cli ARGS` with its log in a file; `url` once it answers /health."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.log = args, port, log
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> SpecdProcess:
        handle = self.log.open("a")
        self.process = subprocess.Popen([sys.executable, "-m", "specd.cli", *self.args, "--port", str(self.port)],
                                        stdout=handle, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_for(lambda: get_json(self.url + "/health")["status"] == "ok", timeout, what=" ".join(self.args[:1]))
        except TimeoutError:
            raise TimeoutError(f"{self.args[0]} did not start; log:\n{self.log.read_text()[-3000:]}") from None
        return self

    def health(self) -> dict[str, Any]:
        return dict(get_json(self.url + "/health"))

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
            self.process = None

    def stop(self) -> None:
        terminate(self.process, 20)
        self.process = None


def tiny_checkpoint(folder: Path) -> Path:
    """A small random Llama checkpoint that uses SmolLM2's real tokenizer and chat template."""
    import transformers

    from specd.model.bundled import bundled_target_dir

    if (folder / "config.json").is_file():
        return folder
    source = bundled_target_dir()
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.15)  # peaked enough that greedy paths are stable
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def post_json(url: str, body: dict[str, Any], timeout: float = 300.0, token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class VllmServer:
    """vLLM's OpenAI server as a process: plain (`speculative` None), n-gram, or specd's proposer.

    `argv` and `env` come from `specd.vllm.launch.vllm_command` for specd, or are built
    here for the others; the model is served under its folder path, as vLLM names it.
    """

    def __init__(self, target: str, port: int, log: Path, argv: list[str] | None = None,
                 env: dict[str, str] | None = None, speculative: dict[str, Any] | None = None,
                 extra: list[str] | None = None) -> None:
        self.target, self.port, self.log = target, port, log
        if argv is None:
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                    "--host", "127.0.0.1", "--port", str(port), *(extra or [])]
            if speculative is not None:
                argv += ["--speculative-config", json.dumps(speculative),
                         "--per-request-spec-decode-metrics", "detailed"]
        self.argv = argv
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> VllmServer:
        handle = self.log.open("a")
        self.process = subprocess.Popen(self.argv, stdout=handle, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while True:  # not wait_for: a server that exits must fail at once, not at the deadline
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                raise RuntimeError(f"vLLM exited with {code}; log:\n{self.log.read_text()[-4000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                if response.status == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM did not start in {timeout:.0f} s; log:\n{self.log.read_text()[-4000:]}")
            time.sleep(1.0)

    def chat(self, content: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
        """One greedy chat completion with token ids and vLLM's per-request metrics."""
        body = {"model": self.target, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, **fields}
        return dict(post_json(self.url + "/v1/chat/completions", body))

    def rpc(self, method: str, *args: Any) -> Any:
        """A worker-extension method through POST /collective_rpc (VLLM_SERVER_DEV_MODE=1)."""
        return post_json(self.url + "/collective_rpc", {"method": method, "args": list(args)})["results"][0]

    def stop(self) -> None:
        terminate(self.process, 30)
        self.process = None


def ask_all(server: VllmServer, prompts: list[str], max_tokens: int, workers: int = 4) -> list[dict[str, Any]]:
    """Every prompt, `workers` at a time (so that vLLM batches and compacts rows); fails naming any
    request that failed."""
    answers: list[Any] = [None] * len(prompts)

    def worker(offset: int) -> None:
        for i in range(offset, len(prompts), workers):
            try:
                answers[i] = server.chat(prompts[i], max_tokens)
            except Exception as error:  # kept, so that the assertion names the failed request
                answers[i] = error

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [(prompts[i], a) for i, a in enumerate(answers) if isinstance(a, Exception)]
    assert not failed, f"requests failed: {failed}"
    return answers


def token_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


class KeepAsking:
    """`clients` threads that keep requests in flight (prompts in turn) until the block ends;
    `answers` holds (prompt, answer or the exception it raised)."""

    def __init__(self, server: VllmServer, prompts: list[str], max_tokens: int, clients: int = 4) -> None:
        self.server, self.prompts, self.max_tokens = server, prompts, max_tokens
        self.answers: list[tuple[str, Any]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(offset,)) for offset in range(clients)]

    def _ask(self, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            try:
                self.answers.append((prompt, self.server.chat(prompt, self.max_tokens)))
            except Exception as error:  # kept, so that the test names the failed request
                self.answers.append((prompt, error))
            i += 1

    def __enter__(self) -> KeepAsking:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
