"""`python -m specjax.serve` as a two-process job (jax.distributed, 2 x 2 CPU devices, gloo):
process 0 serves HTTP and drives the steps, process 1 runs them on its devices. Concurrent
requests get the tokens one process gives; process 0 stopping (SIGINT) ends process 1 cleanly,
process 0 dying (SIGKILL) ends it within the heartbeat timeout."""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from flax import nnx
from live_server import TINY_SERVE, free_port

import specjax
from specjax.engine.distributed import HEARTBEAT_TIMEOUT_S
from specjax.models import Llama, save_hf_checkpoint
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
MAX_TOKENS = 12



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model with 4 KV heads (split over the job's 4 devices) and the bundled
    tokenizer, and one process's greedy and seeded outputs for PROMPTS."""
    folder = tmp_path_factory.mktemp("mp") / "tiny-mp"
    save_hf_checkpoint(Llama(TINY_SERVE.replace(num_kv_heads=4), rngs=nnx.Rngs(5)), folder)
    shutil.copy(CHECKPOINTS_DIR / BUNDLED_TARGET / "tokenizer.json", folder)
    llm = specjax.LLM(str(folder), max_batch_size=4, max_model_len=64, progress=False,
                      speculative_config=specjax.NGramConfig(max_draft_len=3))
    greedy = llm.generate(PROMPTS, specjax.SamplingParams(max_tokens=MAX_TOKENS))
    sampled = llm.generate(PROMPTS, [specjax.SamplingParams(max_tokens=MAX_TOKENS,
                                                            temperature=0.8, seed=i)
                                     for i in range(len(PROMPTS))])
    return folder, [o.text for o in greedy], [o.text for o in sampled]


def start_job(folder) -> tuple[list[subprocess.Popen], str]:
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""),
                                                 "--xla_force_host_platform_device_count=2"]),
           "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "specjax.serve", "--model", str(folder), "--port", str(port),
         "--speculative-config", "ngram", "--max-batch-size", "4", "--max-model-len", "64",
         "--coordinator-address", coordinator, "--num-processes", "2", "--process-id",
         str(i), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        for p in procs:
            if p.poll() is not None:
                stop(procs)
                raise AssertionError(f"a process ended: {p.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return procs, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(procs)
            raise AssertionError("the job did not come up")
        time.sleep(0.5)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def complete(url, prompt, **params) -> str:
    body = {"model": "tiny-mp", "prompt": prompt, "max_tokens": MAX_TOKENS, **params}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.slow   # two processes each compiling every step shape before /health: ~25 s here
def test_two_processes_serve_one_process_tokens_and_stop_together(checkpoint):
    folder, greedy, sampled = checkpoint
    procs, url = start_job(folder)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got_greedy = list(pool.map(lambda p: complete(url, p, temperature=0), PROMPTS))
            got_sampled = list(pool.map(
                lambda ip: complete(url, ip[1], temperature=0.8, seed=ip[0]),
                enumerate(PROMPTS)))
        assert got_greedy == greedy
        assert got_sampled == sampled
        procs[0].send_signal(signal.SIGINT)
        codes = [p.wait(60) for p in procs]
        assert codes == [0, 0], [p.stdout.read()[-3000:] for p in procs]
    finally:
        stop(procs)


@pytest.mark.slow
def test_process_0_dying_ends_process_1_within_the_heartbeat_timeout(checkpoint):
    folder, greedy, _ = checkpoint
    procs, url = start_job(folder)
    try:
        assert complete(url, PROMPTS[0], temperature=0) == greedy[0]
        procs[0].kill()
        start = time.monotonic()
        procs[1].wait(HEARTBEAT_TIMEOUT_S + 30)
        assert time.monotonic() - start < HEARTBEAT_TIMEOUT_S + 30
        assert procs[1].returncode != 0  # ended by JAX's coordination service, not by us
    finally:
        stop(procs)
