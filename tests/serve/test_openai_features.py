"""n > 1, batched prompts, echo, logprobs (both OpenAI shapes), logit_bias and the prefix-cache
metrics, through the official `openai` client: first on a server over the fake engine (exact
logprob values, seeds handed to the engine, failures and cancellation of sibling choices),
then on the live tiny model (seeded samples equal single requests, greedy choices agree, blocks
come back)."""
from __future__ import annotations

import json
import math
import time
import types

import httpx
import pytest
from fakes import FakeEngine, failing_prompt_step, fake_llm, fake_logprobs
from live_server import MODEL_NAME, REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS, serve_in_thread

from specjax.engine.engine import EngineSnapshot
from specjax.serve import ServerSettings, create_app
from specjax.chat import ChatTemplate
from specjax.serve.logprobs import TokenTexts
from specjax.serve.metrics import ServerMetrics
from specjax.serve.protocol import MAX_CHOICES, MAX_N
from specjax.serve.soak import parse_metrics

openai = pytest.importorskip("openai")


# -- helpers ----------------------------------------------------------------------------------

def by_index(chunks, chat: bool = False) -> dict[int, dict]:
    """A stream's chunks gathered per choice: text, finish reasons, logprob lists joined."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"text": "", "reasons": [], "logprobs": None})
            got["text"] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                got["reasons"].append(c.finish_reason)
            if c.logprobs is not None:
                got["logprobs"] = got["logprobs"] or {}
                for k, v in c.logprobs.model_dump().items():
                    if v is not None:
                        got["logprobs"][k] = got["logprobs"].get(k, []) + v
    return out


def whole_logprobs(choice) -> dict:
    return {k: v for k, v in choice.logprobs.model_dump().items() if v is not None}


def refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert not response.headers["content-type"].startswith("text/event-stream")
    assert response.json()["error"]["param"] == param


# -- on the fake engine -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_server(bundled_tokenizer):
    engine = FakeEngine(slots=4, step_delay=0.002, tokenizer=bundled_tokenizer)
    app = create_app(fake_llm(bundled_tokenizer, engine),
                     ServerSettings(model_names=("fake",)), ChatTemplate())
    url, server, thread = serve_in_thread(app)
    yield types.SimpleNamespace(url=url, engine=engine, server=app.state.server,
                                tokenizer=bundled_tokenizer)
    engine.gate.set()
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def fake(fake_server):
    """The fake server, idle and with every block free after each test."""
    fake_server.engine.error_ids.clear()
    yield fake_server
    deadline = time.monotonic() + 10
    engine = fake_server.engine
    while fake_server.server.engine_thread.num_active or engine.has_unfinished():
        assert time.monotonic() < deadline, "the fake server did not go idle"
        time.sleep(0.01)
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


@pytest.fixture
def fake_client(fake):
    return openai.OpenAI(api_key="none", base_url=f"{fake.url}/v1", max_retries=0, timeout=30)


def test_n_and_prompt_batches_index_prompt_major_with_seed_plus_i(fake, fake_client):
    enc = lambda text: fake.tokenizer.encode(text, add_bos=True)
    before = len(fake.engine.added)
    out = fake_client.completions.create(model="fake", prompt=["a", "bc"], n=3, max_tokens=3,
                                         seed=7, temperature=0.5)
    assert [c.index for c in out.choices] == list(range(6))
    added = fake.engine.added[before:]
    assert [p for p, _ in added] == [enc("a")] * 3 + [enc("bc")] * 3
    assert [params.seed for _, params in added] == [7, 8, 9, 7, 8, 9]
    # usage: each prompt's tokens once (OpenAI's and vLLM's rule), every choice's output.
    assert out.usage.prompt_tokens == len(enc("a")) + len(enc("bc"))
    assert out.usage.completion_tokens == 6 * 3
    # Seeds wrap within uint32; unseeded samples leave the seed to the engine.
    before = len(fake.engine.added)
    fake_client.completions.create(model="fake", prompt="a", n=2, max_tokens=1, seed=2**32 - 1)
    fake_client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a"}],
                                        n=2, max_tokens=1)
    assert [params.seed for _, params in fake.engine.added[before:]] == [2**32 - 1, 0, None, None]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_interleave_each_with_its_finish(fake, fake_client, chat):
    if chat:
        chunks = list(fake_client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "a"}], n=3, max_tokens=4,
            stream=True, stream_options={"include_usage": True}))
        roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
        assert roles == [0, 1, 2]
    else:
        chunks = list(fake_client.completions.create(
            model="fake", prompt=[[7, 5], [5, 6]], n=2, max_tokens=4, stream=True,
            stream_options={"include_usage": True}))
    got = by_index(chunks[:-1], chat)
    assert sorted(got) == list(range(len(got))) and len(got) in (3, 4)
    assert all(g["reasons"] == ["length"] for g in got.values())
    text = fake.tokenizer.decode([1, 2, 3, 4])
    assert all(g["text"] == text for g in got.values())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4 * len(got)
    indexes = [c.choices[0].index for c in chunks[:-1]]
    assert indexes != sorted(indexes)   # interleaved, not one choice after another


def test_completion_logprobs_shape_and_values(fake, fake_client):
    texts = TokenTexts(fake.tokenizer)
    out = fake_client.completions.create(model="fake", prompt="a", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == [texts.text(t) for t in (1, 2, 3, 4)]
    assert lp.token_logprobs == [fake_logprobs(t, 2)[t] for t in (1, 2, 3, 4)]
    # top_logprobs: the engine's dict, top 2 plus the chosen token when outside them.
    assert [len(d) for d in lp.top_logprobs] == [3, 2, 3, 2]
    assert lp.top_logprobs[1] == {texts.text(t): v for t, v in fake_logprobs(2, 2).items()}
    text = out.choices[0].text
    assert lp.text_offset == [len(fake.tokenizer.decode([1, 2, 3, 4][:i])) for i in range(4)]
    assert all(0 <= o <= len(text) for o in lp.text_offset)
    assert fake.engine.added[-1][1].logprobs == 2
    assert fake.engine.added[-1][1].prompt_logprobs is None


def test_echo_puts_the_prompt_first(fake, fake_client):
    prompt = "def f"
    ids = fake.tokenizer.encode(prompt, add_bos=True)
    plain = fake_client.completions.create(model="fake", prompt=prompt, max_tokens=2, echo=True)
    assert plain.choices[0].text == prompt + fake.tokenizer.decode([1, 2])
    assert fake.engine.added[-1][1].prompt_logprobs is None
    # Token ids are echoed as their text.
    by_ids = fake_client.completions.create(model="fake", prompt=ids, max_tokens=2, echo=True)
    assert by_ids.choices[0].text == plain.choices[0].text
    out = fake_client.completions.create(model="fake", prompt=prompt, max_tokens=2, echo=True,
                                         logprobs=1)
    assert fake.engine.added[-1][1].prompt_logprobs == 1
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 == out.usage.prompt_tokens + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == [fake_logprobs(t, 1)[t] for t in ids[1:]]
    assert lp.token_logprobs[len(ids):] == [fake_logprobs(t, 1)[t] for t in (1, 2)]
    assert lp.text_offset[len(ids)] == len(prompt)   # generated offsets follow the prompt
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)])


def test_chat_logprobs_shape(fake, fake_client):
    texts = TokenTexts(fake.tokenizer)
    out = fake_client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "a"}], max_tokens=3,
        logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [texts.text(t) for t in (1, 2, 3)]
    assert [c.logprob for c in content] == [fake_logprobs(t, 2)[t] for t in (1, 2, 3)]
    assert [bytes(c.bytes) for c in content] == [texts.get(t)[1] for t in (1, 2, 3)]
    assert all(len(c.top_logprobs) == 2 for c in content)        # exactly k
    assert [t.logprob for t in content[0].top_logprobs] == [-0.1, -0.2]
    # logprobs alone: the chosen token, no alternatives.
    out = fake_client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "a"}], max_tokens=2, logprobs=True)
    assert [c.top_logprobs for c in out.choices[0].logprobs.content] == [[], []]
    assert fake.engine.added[-1][1].logprobs == 0
    plain = fake_client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert plain.choices[0].logprobs is None and fake.engine.added[-1][1].logprobs is None


@pytest.mark.parametrize("kind", ["completions", "echo", "chat"])
def test_streamed_logprobs_equal_whole(fake, fake_client, kind):
    if kind == "chat":
        create = lambda **kw: fake_client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=9, n=2,
            logprobs=True, top_logprobs=3, **kw)
    else:
        create = lambda **kw: fake_client.completions.create(
            model="fake", prompt=["ab", "日本"], max_tokens=9, n=2, logprobs=3,
            echo=kind == "echo", **kw)
    whole = create()
    streamed = by_index(create(stream=True), chat=kind == "chat")
    assert sorted(streamed) == [c.index for c in whole.choices]
    for c in whole.choices:
        assert streamed[c.index]["logprobs"] == whole_logprobs(c)
        assert streamed[c.index]["text"] == (c.message.content if kind == "chat" else c.text)


def test_logit_bias_reaches_the_sampling_parameters(fake, fake_client):
    fake_client.completions.create(model="fake", prompt="a", max_tokens=1,
                                   logit_bias={"42": -100, "17": 5.5})
    assert fake.engine.added[-1][1].logit_bias == ((17, 5.5), (42, -100))
    fake_client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a"}],
                                        max_tokens=1, logit_bias={"3": 1})
    assert fake.engine.added[-1][1].logit_bias == ((3, 1),)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[1, 2], []], "n": 2}, "prompt"),
    ({"prompt": ["a", "b"], "n": MAX_N + 1}, "n"),
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
    ({"prompt": "a", "n": 2, "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": 100.5}}, "logit_bias"),
    ({"prompt": "a", "echo": True, "max_tokens": 0}, "max_tokens"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_submit_nothing(fake, body, param, stream):
    before = len(fake.engine.added)
    refused(httpx.post(f"{fake.url}/v1/completions",
                       json={"model": "fake", "max_tokens": 2, "stream": stream, **body}), param)
    assert len(fake.engine.added) == before


@pytest.fixture
def slow_fake(fake):
    """Steps of 20 ms: a 100-token request outlives any cancellation."""
    fake.engine.step_delay, saved = 0.02, fake.engine.step_delay
    yield fake
    fake.engine.step_delay = saved


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_request_and_cancels_the_others(slow_fake, stream):
    fake = slow_fake
    engine = fake.engine
    before = len(engine.added)
    engine.error_ids.add(engine._next + 1)      # the second of the three choices
    body = {"model": "fake", "prompt": "a", "n": 3, "max_tokens": 100, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{fake.url}/v1/completions", json=body) as response:
            events = [line[len("data: "):] for line in response.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "internal_error"
        assert all("error" not in json.loads(e) for e in events[:-2])
    else:
        response = httpx.post(f"{fake.url}/v1/completions", json=body)
        assert response.status_code == 500 and "secret" not in response.text
    assert len(engine.added) == before + 3
    ids = {before, before + 2}                  # the siblings were aborted, not run out
    deadline = time.monotonic() + 10
    while not ids <= set(engine.aborted):
        assert time.monotonic() < deadline, engine.aborted
        time.sleep(0.01)


def test_a_disconnected_stream_cancels_every_choice(slow_fake):
    fake = slow_fake
    engine = fake.engine
    before = len(engine.added)
    body = {"model": "fake", "prompt": ["a", "b"], "n": 2, "max_tokens": 120, "stream": True}
    with httpx.stream("POST", f"{fake.url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break                          # one chunk, then the client leaves
    ids = set(range(before, before + 4))
    deadline = time.monotonic() + 10
    while not ids <= set(engine.aborted):
        assert time.monotonic() < deadline, engine.aborted
        time.sleep(0.01)


def test_full_queue_refuses_the_whole_request(fake):
    thread = fake.server.engine_thread
    thread.max_queue, saved = 2, thread.max_queue
    try:
        before = len(fake.engine.added)
        response = httpx.post(f"{fake.url}/v1/completions",
                              json={"model": "fake", "prompt": "a", "n": 3, "max_tokens": 2})
        assert response.status_code == 429 and len(fake.engine.added) == before
    finally:
        thread.max_queue = saved


def test_prefix_cache_gauges_read_the_snapshot():
    snap = EngineSnapshot(prefix_cache_hit_rate=0.25, prefix_cache_blocks=3)
    m = parse_metrics(ServerMetrics(types.SimpleNamespace(snapshot=snap)).render().decode())
    assert m["specjax_prefix_cache_hit_rate"] == 0.25
    assert m["specjax_prefix_cache_blocks"] == 3
    m = parse_metrics(ServerMetrics(types.SimpleNamespace(snapshot=EngineSnapshot()))
                      .render().decode())
    assert math.isnan(m["specjax_prefix_cache_hit_rate"])   # no lookups yet, or cache off


# -- on the live tiny model -------------------------------------------------------------------

@pytest.fixture
def client(server):
    return openai.OpenAI(api_key=server.headers["Authorization"].split()[1],
                         base_url=f"{server.url}/v1", max_retries=0, timeout=60)


def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(server, client):
    kwargs = dict(model=MODEL_NAME, prompt="def f(x):", max_tokens=8, temperature=0.9)
    many = client.completions.create(**kwargs, n=3, seed=123)
    singles = [client.completions.create(**kwargs, seed=123 + i).choices[0] for i in range(3)]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    assert len({c.text for c in singles}) == 3        # different seeds, different samples
    streamed = by_index(client.completions.create(**kwargs, n=3, seed=123, stream=True))
    assert [streamed[i]["text"] for i in range(3)] == [c.text for c in singles]
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                temperature=0.9)
    many = client.chat.completions.create(**chat, n=2, seed=5)
    singles = [client.chat.completions.create(**chat, seed=5 + i) for i in range(2)]
    assert [c.message.content for c in many.choices] == \
        [s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens   # counted once


def test_greedy_choices_agree_and_batches_follow_the_prompts(server, client):
    ref = [server.reference[p] for p in REFERENCE_PROMPTS[:2]]
    out = client.completions.create(model=MODEL_NAME, temperature=0, n=2,
                                    max_tokens=REFERENCE_MAX_TOKENS,
                                    prompt=[ref[0].prompt_token_ids, ref[1].prompt_token_ids])
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [ref[0].text] * 2 + [ref[1].text] * 2
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert out.usage.completion_tokens == 4 * REFERENCE_MAX_TOKENS
    streamed = by_index(client.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=REFERENCE_MAX_TOKENS, stream=True,
        prompt=list(REFERENCE_PROMPTS[:2]), n=2))
    assert [streamed[i]["text"] for i in range(4)] == [ref[0].text] * 2 + [ref[1].text] * 2
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0, n=2, max_tokens=8,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_echo_on_the_model(server, client):
    prompt = REFERENCE_PROMPTS[0]
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, echo=True,
                                    max_tokens=REFERENCE_MAX_TOKENS)
    assert out.choices[0].text == prompt + server.reference[prompt].text


def test_choices_free_their_blocks_even_when_cancelled(server, client, monkeypatch):
    engine = server.llm.engine
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), real_step())[1])
    before = server.metrics().get('specjax_requests_total{outcome="cancelled"}', 0)
    client.completions.create(model=MODEL_NAME, prompt=["a", "b"], n=3, max_tokens=5)
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "n": 3, "max_tokens": 90,
            "temperature": 0.8, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers=server.headers) as response:
        got = 0
        for line in response.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
    m = server.wait_idle()
    monkeypatch.undo()
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    assert m['specjax_requests_total{outcome="cancelled"}'] >= before + 1


BAD_PROMPT = [11, 12, 13, 14]


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_the_engine_fails_fails_the_request(server, monkeypatch, stream):
    engine = server.llm.engine
    monkeypatch.setattr(engine, "step", failing_prompt_step(engine, BAD_PROMPT))
    body = {"model": MODEL_NAME, "prompt": [[1, 2, 3], BAD_PROMPT], "n": 2, "max_tokens": 60,
            "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          headers=server.headers) as response:
            events = [line[len("data: "):] for line in response.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    else:
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
        assert response.status_code == 500
    server.wait_idle()
    monkeypatch.undo()
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


def test_prefix_cache_gauges_on_the_model(server):
    m = server.metrics()
    assert "specjax_prefix_cache_hit_rate" in m and m["specjax_prefix_cache_blocks"] >= 0


# -- needs the engine's logprobs and logit_bias -----------------------------------------------

def test_logprobs_on_the_model(server, client):
    """Real shapes: one entry per generated token; greedy picks the most likely token; the
    stream adds up to the same lists; echo reports the prompt first."""
    prompt = REFERENCE_PROMPTS[1]
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                    max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)   # greedy: the top token
    streamed = by_index(client.completions.create(model=MODEL_NAME, prompt=prompt,
                                                  temperature=0, max_tokens=6, logprobs=3,
                                                  stream=True))
    # The same tokens and top entries; the values to float precision (a step verifying a
    # different number of drafts, which the cost model may choose, computes them in another
    # program, and this random model's top logits lie within 1e-2 of each other).
    whole, parts = whole_logprobs(out.choices[0]), streamed[0]["logprobs"]
    assert parts.keys() == whole.keys()
    assert parts["tokens"] == whole["tokens"] and parts["text_offset"] == whole["text_offset"]
    assert parts["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)
    for got, ref in zip(parts["top_logprobs"], whole["top_logprobs"], strict=True):
        assert got.keys() == ref.keys() and got == pytest.approx(ref, abs=1e-5)
    echo = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                     max_tokens=2, logprobs=1, echo=True)
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == echo.usage.prompt_tokens + 2
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)


def test_logit_bias_on_the_model(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt="def", temperature=0,
                                    max_tokens=5, logit_bias={"300": 100})
    assert out.choices[0].text == server.tokenizer.decode([300] * 5)
