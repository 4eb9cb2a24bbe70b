"""One live server for the serving tests: a tiny random model with the bundled tokenizer,
draft-target speculation with a tiny draft, an API key, run by uvicorn in a thread on a free
loopback port. It is shared by every module here; each test leaves it idle and error-free."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from flax import nnx  # noqa: E402
from live_server import (API_KEY, MODEL_NAME, REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS,  # noqa: E402
                         TINY_SERVE, LiveServer, serve_in_thread)

import specjax  # noqa: E402
from specjax.models import Llama  # noqa: E402
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR  # noqa: E402
from specjax.serve import ServerSettings, create_app  # noqa: E402
from specjax.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def bundled_tokenizer() -> Tokenizer:
    folder = CHECKPOINTS_DIR / BUNDLED_TARGET
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the bundled checkpoint is not in this checkout")
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="session")
def live(bundled_tokenizer):
    model = Llama(TINY_SERVE, rngs=nnx.Rngs(0))
    draft = Llama(TINY_SERVE.replace(num_layers=1), rngs=nnx.Rngs(1))
    spec = specjax.DraftTargetConfig(max_draft_len=2, speculative_model=draft)
    # 4 slots for 32 clients: most wait in the engine's queue.
    llm = specjax.LLM(model, tokenizer=bundled_tokenizer, max_batch_size=4, tokens_per_block=8,
                      prefill_chunk=16, speculative_config=spec, progress=False, seed=0,
                      warmup=True)  # as the server does: no request waits on a compile
    # The reference, from the same LLM before the engine thread owns it.
    greedy = specjax.SamplingParams(max_tokens=REFERENCE_MAX_TOKENS)
    reference = dict(zip(REFERENCE_PROMPTS, llm.generate(REFERENCE_PROMPTS, greedy)))
    settings = ServerSettings(model_names=(MODEL_NAME, "tiny-alias"), api_key=API_KEY,
                              max_queue=64, max_tokens_cap=100, max_body_bytes=64 * 1024,
                              shutdown_timeout=5)
    app = create_app(llm, settings)
    url, server, thread = serve_in_thread(app)
    live = LiveServer(url, app, llm, bundled_tokenizer, reference, server, thread)
    yield live
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive(), "uvicorn did not shut down"
    assert not live.server.engine_thread.alive


@pytest.fixture
def server(live):
    """The live server, checked after each test: idle, every KV block free, no engine errors
    (a test that injects one clears it)."""
    yield live
    live.wait_idle()
    assert live.server.engine_thread.errors == []
