"""A live server for tests: uvicorn in a thread on a loopback port, and what tests read of it
(imported by conftest.py and the test modules)."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

import httpx
import uvicorn

import specjax
from specjax.models import ModelConfig
from specjax.serve.http_server import build_server
from specjax.serve.soak import parse_metrics
from specjax.tokenizer import Tokenizer

API_KEY = "test-key-7f3a"
MODEL_NAME = "tiny-serve"
# The bundled tokenizer's vocabulary, so text round-trips; no EOS, so lengths are exact.
TINY_SERVE = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                         eos_token_id=None)
REFERENCE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
REFERENCE_MAX_TOKENS = 24


@dataclasses.dataclass
class LiveServer:
    url: str
    app: object
    llm: specjax.LLM
    tokenizer: Tokenizer
    reference: dict[str, specjax.RequestOutput]   # greedy LLM.generate outputs, by prompt
    uvicorn_server: uvicorn.Server
    thread: threading.Thread

    @property
    def server(self):
        return self.app.state.server

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def metrics(self) -> dict[str, float]:
        """The unlabelled (and labelled, key with labels) samples of /metrics."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", headers=self.headers,
                                       timeout=10).text)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["specjax_requests_running"] == 0 and m["specjax_requests_waiting"] == 0
                    and m["specjax_kv_blocks_free"] == m["specjax_kv_blocks_total"]):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.05)


def free_port() -> int:
    """A loopback port free now (for a subprocess that binds it itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_in_thread(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Start the app (`create_app`'s, or any ASGI app with `app.state.server`) the way
    `python -m specjax.serve` does, on a socket we bound ourselves (port 0: no race for a
    free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = build_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread
