"""Real processes on loopback for the service tests and benchmarks: Mosquitto, `specd learner`,
`specd serve`, vLLM. Test and benchmark support, importable without `sys.path` edits; specd never imports it.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def program(name: str, fallback: str) -> str | None:
    """The program's path: on PATH, or where Debian puts it (PATH may lack /usr/sbin)."""
    return shutil.which(name) or (fallback if os.access(fallback, os.X_OK) else None)


def mosquitto_binary() -> str | None:
    return program("mosquitto", "/usr/sbin/mosquitto")


def chromium_binary() -> str | None:
    return program("chromium", "/usr/bin/chromium")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check, timeout: float = 60.0, interval: float = 0.2, what: str = "condition",
             explain: Callable[[], str] | None = None) -> Any:
    """Poll `check` until it returns something true; on timeout, `explain()` (if given) says what the
    services last reported, so a failure in CI can be read without the logs that pytest prunes."""
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
    details = ""
    if explain is not None:
        try:
            details = f"; {explain()}"
        except Exception as error:  # the timeout stays the failure, whatever the explanation hit
            details = f"; explaining it failed: {error!r}"
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_error}){details}")


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

    def __init__(self, folder: Path, max_queued_messages: int = 100_000) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mosquitto.conf").write_text(
            # user root: as root, mosquitto would drop to a "mosquitto" user that cannot write here
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\nuser root\npersistence true\n"
            f"persistence_location {folder}/\nmax_queued_messages {max_queued_messages}\nautosave_interval 1\n")

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> Broker:
        binary = mosquitto_binary()
        if binary is None:
            raise FileNotFoundError("mosquitto is not installed; install it with `bash scripts/system-deps`")
        with (self.folder / "mosquitto.log").open("ab") as log:  # kept across restarts, beside its config
            self.process = subprocess.Popen([binary, "-c", str(self.folder / "mosquitto.conf")],
                                            stdout=log, stderr=subprocess.STDOUT)

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
    """`python -m specd.cli.main ARGS` with its log in a file; `url` once it answers /health."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.log = args, port, log
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> SpecdProcess:
        handle = self.log.open("a")
        self.process = subprocess.Popen([sys.executable, "-m", "specd.cli.main", *self.args, "--port", str(self.port)],
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

    `argv` and `env` come from `specd.serving.vllm.shared.launch.vllm_command` for specd, or are built
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


class TlsBroker(Broker):
    """Mosquitto with TLS only (a self-signed CA made here, a certificate for 127.0.0.1 and localhost)
    and a password file holding one user; anonymous clients are refused."""

    def __init__(self, folder: Path, username: str, password: str) -> None:
        super().__init__(folder)
        self.username, self.password = username, password
        self.ca = folder / "ca.pem"
        certificate, key = folder / "server.pem", folder / "server.key"
        write_test_certificates(self.ca, certificate, key)
        passwords = folder / "passwords"
        passwords.write_text(mosquitto_password_line(username, password) + "\n")
        passwords.chmod(0o600)
        (folder / "mosquitto.conf").write_text(
            f"listener {self.port} 127.0.0.1\ncafile {self.ca}\ncertfile {certificate}\nkeyfile {key}\n"
            f"password_file {passwords}\nallow_anonymous false\nuser root\n")

    @property
    def url(self) -> str:
        return f"mqtts://{self.username}:{self.password}@127.0.0.1:{self.port}"


def write_test_certificates(ca_path: Path, certificate_path: Path, key_path: Path) -> None:
    """A CA and a server certificate it signed, valid for a day, for 127.0.0.1 and localhost."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specd test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certificate_path.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    key_path.chmod(0o600)


def mosquitto_password_line(username: str, password: str) -> str:
    """A password-file line as `mosquitto_passwd` writes it in the format every Mosquitto since 1.4
    reads ($6$: base64 salt, base64 SHA-512 of password + salt), so the test needs no second tool."""
    import base64
    import hashlib

    salt = os.urandom(12)
    digest = hashlib.sha512(password.encode() + salt).digest()
    return f"{username}:$6${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
