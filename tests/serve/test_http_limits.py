"""The HTTP layer's limits, on a server whose engine is a fake (no model, no compile): slow
clients get a 408 or are disconnected while others are served, the concurrency limit answers
503, unknown Host headers 400, and shutdown ends what is left with an error in bounded time."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest
from fakes import FakeEngine, fake_llm
from live_server import serve_in_thread

from specjax.serve import ServerSettings, create_app, prepare
from specjax.chat import ChatTemplate
from specjax.serve.hosts import allowed_hosts_for, normalize_host

BODY = {"model": "fake", "prompt": "a", "max_tokens": 120}


@contextlib.contextmanager
def running(tokenizer, engine: FakeEngine | None = None, **settings) -> Iterator[tuple]:
    engine = engine or FakeEngine(slots=4)
    app = create_app(fake_llm(tokenizer, engine), ServerSettings(model_names=("fake",),
                                                                 **settings), ChatTemplate())
    url, server, thread = serve_in_thread(app)
    try:
        yield url, app.state.server, engine, server, thread
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def _raw(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def _error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_slow_clients_are_cut_off_while_others_are_served(bundled_tokenizer):
    # The cut-off is long enough that five health checks fit before it on a loaded 2-core
    # machine: served after it would mean they waited for the stalled clients.
    timeout = 3.0
    with running(bundled_tokenizer, request_timeout=timeout) as (url, *_):
        start = time.monotonic()
        silent = _raw(url, b"")
        half_head = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        half_body = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                              b'{"model": ')
        for _ in range(5):   # served meanwhile, without waiting for the stalled ones
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert time.monotonic() - start < timeout - 0.5
        responses = [_read_all(s) for s in (silent, half_head, half_body)]
        took = time.monotonic() - start
        assert timeout - 0.05 < took < timeout + 2.5
        assert responses[0] == b""                    # nothing was asked: just closed
        for response in responses[1:]:
            status, error = _error_of(response)
            assert status == 408 and error["code"] == "request_timeout"
            assert b"connection: close" in response.lower()


def test_concurrency_limit_is_a_json_503(bundled_tokenizer):
    engine = FakeEngine(slots=4, step_delay=0.02)
    with running(bundled_tokenizer, engine, max_concurrency=2) as (url, server, *_):
        with httpx.Client(base_url=url, timeout=10) as client:
            with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}), \
                    client.stream("POST", "/v1/completions", json={**BODY, "stream": True}):
                refused = client.post("/v1/completions", json=BODY)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "server_busy"
                assert client.get("/health").status_code == 200     # probes are exempt
                assert client.get("/metrics").status_code == 200
            deadline = time.monotonic() + 10   # the streams' slots come back as they end
            while (status := client.post("/v1/completions",
                                         json={**BODY, "max_tokens": 2}).status_code) == 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert status == 200


@pytest.mark.parametrize("host, status", [
    ("evil.example.com", 400), ("evil.example.com:8000", 400), ("127.0.0.1.evil.com", 400),
    ("a b", 400), ("localhost", 200), ("LOCALHOST:9", 200), ("127.0.0.1:1", 200),
    ("[::1]:8000", 200), ("[::1]", 200)])
def test_host_header_is_checked(host, status, fake_server):
    response = httpx.get(f"{fake_server}/v1/models", headers={"Host": host}, timeout=5)
    assert response.status_code == status
    if status == 400:
        assert response.json()["error"]["code"] == "invalid_host"


def test_head_health(fake_server):
    response = httpx.head(f"{fake_server}/health", timeout=5)
    assert response.status_code == 200 and response.content == b""


@pytest.fixture(scope="module")
def fake_server(bundled_tokenizer):
    with running(bundled_tokenizer) as (url, *_):
        yield url


def test_allowed_hosts():
    loopback = ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts_for("127.0.0.1") == loopback
    assert allowed_hosts_for("::1") == loopback
    assert allowed_hosts_for("localhost") == loopback
    assert allowed_hosts_for("0.0.0.0") == ("*",) == allowed_hosts_for("::")
    assert allowed_hosts_for("192.168.1.5") == loopback + ("192.168.1.5",)
    assert allowed_hosts_for("fe80::1") == loopback + ("[fe80::1]",)
    assert allowed_hosts_for("0.0.0.0", ["api.example.com", " ::1", "*"]) == \
        ("api.example.com", "[::1]", "*")
    assert normalize_host("[0:0::1]") == "[::1]" and normalize_host("*.Example.com") == \
        "*.example.com"
    for bad in ["host:80", "http://x", "a*.b", "*x.com"]:
        with pytest.raises(ValueError):
            normalize_host(bad)
    with pytest.raises(ValueError, match="empty"):
        allowed_hosts_for("127.0.0.1", ["", " "])


def test_shutdown_is_bounded(bundled_tokenizer, monkeypatch):
    engine = FakeEngine(slots=4, step_delay=0.02)   # 120 tokens: 2.4 s at the least
    with running(bundled_tokenizer, engine, shutdown_timeout=1.0) as (url, _, _, uv, thread):
        results: dict[str, httpx.Response] = {}
        encoding = threading.Event()
        real_encode = prepare.encode_text

        def slow_encode(tokenizer, text, add_bos):
            if text == "late":
                encoding.set()
                time.sleep(0.8)
            return real_encode(tokenizer, text, add_bos)

        monkeypatch.setattr(prepare, "encode_text", slow_encode)

        def post(name: str, body: dict) -> None:
            results[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)

        with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")            # it is generating
            posts = [threading.Thread(target=post, args=("whole", BODY)),
                     threading.Thread(target=post, args=("late", {**BODY, "prompt": "late"}))]
            for t in posts:
                t.start()
            assert encoding.wait(10)
            time.sleep(0.1)                                     # "whole" is in the engine
            start = time.monotonic()
            uv.should_exit = True
            events = [line for line in lines if line.startswith("data: ")]
        took = time.monotonic() - start
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
        assert 0.9 < took < 2.5          # the timeout, not the 2.4 s generation
        for t in posts:
            t.join(10)
        assert results["whole"].status_code == 503
        assert results["whole"].json()["error"]["code"] == "shutting_down"
        assert results["late"].status_code == 503     # submitted after shutdown began
        assert results["late"].json()["error"]["code"] == "shutting_down"
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - start < 4


def test_a_1_mib_prompt_does_not_stall_the_event_loop(bundled_tokenizer):
    """Tokenising it takes about a second (and is then refused: the fake's context is 128
    tokens); /health answers throughout."""
    prompt = ("def f(x): return x * 2  # twice; " * 40_000)[:(1 << 20) - 200]
    with running(bundled_tokenizer) as (url, *_):
        result: dict = {}
        big = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/completions", json={**BODY, "prompt": prompt}, timeout=60)))
        start = time.monotonic()
        big.start()
        latencies = []
        while big.is_alive():
            t = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.02)
        took = time.monotonic() - start
        assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "prompt"
        assert took > 0.3 and len(latencies) >= 5        # the probes ran while it was busy
        assert max(latencies) < max(0.25, took / 3), (took, sorted(latencies)[-3:])
