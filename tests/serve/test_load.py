"""Many clients at once against the live server (4 slots), and clients that leave early: every
stream completes or is cancelled, and the KV pool is whole again afterwards."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from live_server import MODEL_NAME

from specjax.serve import loadtest

CLIENTS, MAX_TOKENS = 32, 24


def test_32_concurrent_streams_complete_and_free_the_pool(server):
    peak_waiting, stop = [0.0], threading.Event()

    def watch_queue():  # /metrics while the load runs: did requests really queue?
        while not stop.is_set():
            peak_waiting[0] = max(peak_waiting[0], server.metrics()["specjax_requests_waiting"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_queue, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        results, _ = asyncio.run(loadtest.run_load(server.url, CLIENTS, MAX_TOKENS,
                                                   api_key=server.headers["Authorization"][7:],
                                                   timeout=120))
    finally:
        stop.set()
        watcher.join()
    assert time.monotonic() - start < 120
    assert len(results) == CLIENTS
    for r in results:
        assert r.status == 200 and r.error is None and r.completed, r
        assert r.completion_tokens == MAX_TOKENS and r.finish_reason == "length"
        assert r.ttft is not None and r.ttft <= r.latency
    # Greedy and deterministic: the same prompt streamed alone gives the same text.
    alone, _ = asyncio.run(loadtest.run_load(server.url, 1, MAX_TOKENS, model=MODEL_NAME,
                                             api_key=server.headers["Authorization"][7:]))
    assert alone[0].text == results[0].text
    assert peak_waiting[0] > 0  # 32 clients, 4 slots
    m = server.wait_idle(timeout=10)
    assert m["specjax_kv_blocks_free"] == server.llm.engine.allocator.total_blocks


def _cancelled(server) -> float:
    return server.metrics().get('specjax_requests_total{outcome="cancelled"}', 0.0)


def test_streaming_clients_that_disconnect_free_their_blocks(server, monkeypatch):
    engine = server.llm.engine
    real_step = engine.step

    def slow_step():  # so the requests are surely mid-stream when their clients leave
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    before, leavers = _cancelled(server), 6

    async def leave_after_first_chunk(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL_NAME, "prompt": f"def g{i}():", "max_tokens": 100,
                "temperature": 0, "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body,
                                 headers=server.headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"text":"' in line:
                    return line  # leaving the block closes the connection mid-stream
        raise AssertionError("the stream ended before its first text")

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(leave_after_first_chunk(client, i)
                                          for i in range(leavers)))

    assert len(asyncio.run(run())) == leavers
    m = server.wait_idle(timeout=20)
    assert m["specjax_kv_blocks_free"] == m["specjax_kv_blocks_total"]
    assert _cancelled(server) == before + leavers
    assert not server.server.engine_thread._live


def test_non_streaming_client_that_gives_up_is_cancelled(server, monkeypatch):
    engine = server.llm.engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = _cancelled(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=0.5,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 100})
    server.wait_idle(timeout=20)
    assert _cancelled(server) == before + 1


def test_loadtest_cli_prints_the_summary(server, capsys):
    code = loadtest.main(["--url", server.url, "--clients", "4", "--max-tokens", "5",
                          "--api-key", server.headers["Authorization"][7:]])
    out = capsys.readouterr().out
    assert code == 0
    assert "requests: 4 (4 completed, 0 failed)" in out
    assert "tokens: 20 in" in out and "tokens/s" in out
    assert "time to first token: p50" in out and "p99" in out
