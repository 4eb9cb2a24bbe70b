"""The HTTP API against a live server: the official `openai` client for what works, httpx
for what must be refused (before any stream opens), auth, limits, metrics and failures."""
from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

from specjax.serve.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS

from fakes import failing_prompt_step
from live_server import API_KEY, MODEL_NAME, REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS

openai = pytest.importorskip("openai")


@pytest.fixture
def client(server):
    return openai.OpenAI(api_key=API_KEY, base_url=f"{server.url}/v1", max_retries=0,
                         timeout=60)


# -- what works, through the official client ------------------------------------------------

@pytest.mark.parametrize("prompt", REFERENCE_PROMPTS)
def test_completion_greedy_equals_llm_generate(server, client, prompt):
    ref = server.reference[prompt]
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                    max_tokens=REFERENCE_MAX_TOKENS)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids) == REFERENCE_MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_stream_adds_up_to_the_same_text(server, client):
    prompt = REFERENCE_PROMPTS[0]
    ref = server.reference[prompt]
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=REFERENCE_MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # usage only in the last chunk, which has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == REFERENCE_MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(server, client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=4,
                                            temperature=0, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason


def test_token_id_prompt_and_default_max_tokens(server, client):
    ref = server.reference[REFERENCE_PROMPTS[1]]
    out = client.completions.create(model=MODEL_NAME, prompt=ref.prompt_token_ids,
                                    temperature=0)
    assert out.usage.completion_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's 16
    assert ref.text.startswith(out.choices[0].text)


def test_stop_string_cuts_streamed_and_whole_text_alike(server, client):
    ref = server.reference[REFERENCE_PROMPTS[2]].text
    stop = ref[8:11]
    assert stop and ref.find(stop) >= 1
    expected = ref[:ref.find(stop)]
    whole = client.completions.create(model=MODEL_NAME, prompt=REFERENCE_PROMPTS[2],
                                      temperature=0, max_tokens=REFERENCE_MAX_TOKENS, stop=stop)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=REFERENCE_PROMPTS[2],
                                         temperature=0, max_tokens=REFERENCE_MAX_TOKENS,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seeded_sampling_repeats(server, client):
    kwargs = dict(model=MODEL_NAME, prompt="def f(x):", max_tokens=10, temperature=0.9,
                  top_p=0.95, seed=123)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    other = client.completions.create(**{**kwargs, "seed": 124}).choices[0].text
    assert other != a  # 10 random tokens from 4096: equal only if seeds are ignored
    # top_k and min_p arrive through extra_body (extensions) and change the draw.
    ranked = client.completions.create(**kwargs, extra_body={"top_k": 1}).choices[0].text
    greedy = client.completions.create(**{**kwargs, "temperature": 0}).choices[0].text
    assert ranked == greedy


def test_chat_default_template_greedy_and_stream(server, client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "Say "},
                                             {"type": "text", "text": "hi"}]}]
    rendered = "system: You write Python.\nuser: Say hi\nassistant: "
    prompt_ids = server.tokenizer.encode(rendered, add_bos=True)
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                         max_completion_tokens=12)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 12
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    # The same prompt as a completion gives the same text: the template is what we say it is.
    same = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, temperature=0,
                                     max_tokens=12)
    assert same.choices[0].text == out.choices[0].message.content


def test_models_health_and_model_alias(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").json() == {
        "status": "ok", "warming_up": False, "matmul": server.llm.stats.matmul}
    assert server.llm.stats.matmul == server.llm.engine.config.matmul_path()
    out = client.completions.create(model="tiny-alias", prompt="a", max_tokens=2)
    assert out.usage.completion_tokens == 2


# -- what is refused, before any stream opens -------------------------------------------------

LONG = list(range(1, 201))   # 200 tokens: the context holds 128
LONG_TEXT = "x " * 300
BAD_COMPLETIONS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "guided_json"),
    ({"guided_regex": "[a-", "max_tokens": 4}, "guided_regex"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),        # over the server's cap (100)
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**40}, "seed"),
    ({"seed": True}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),                            # MAX_N
    ({"n": 1.5}, "n"),
    ({"best_of": 3}, "best_of"),                  # only best_of = n is accepted
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),               # MAX_LOGPROBS
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),   # OpenAI's [-2, 2]
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),     # keys are token ids
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"1.5": 5}}, "logit_bias"),
    ({"logit_bias": {"17": 101}}, "logit_bias"),  # [-100, 100]
    ({"logit_bias": {"17": "a"}}, "logit_bias"),
    ({"logit_bias": {"4096": 1}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"suffix": "end"}, "suffix"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"model": "gpt-4"}, "model"),
    ({"model": None}, "model"),
    ({"prompt": LONG}, "prompt"),                 # longer than the context
    ({"prompt": [5000]}, "prompt"),               # outside the vocabulary
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),           # a batch of mixed kinds
    ({"prompt": [[1, 2], []]}, "prompt"),         # one bad prompt refuses the batch
    ({"prompt": ["a", LONG_TEXT]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),          # over MAX_CHOICES
    ({"prompt": ["a", "b"], "n": 65}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"frobnicate": 1}, "frobnicate"),            # unknown argument
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"messages": [{"role": "user", "content": "x " * 300}]}, "messages"),   # too long
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"top_logprobs": 3}, "top_logprobs"),        # needs logprobs: true
    ({"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": -100.5}}, "logit_bias"),
    ({"response_format": {"type": "json_object", "x": 1}, "guided_regex": "a"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "(", "max_tokens": 4}, "guided_regex"),
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 101}, "max_tokens"),
]


def _assert_refused(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert not response.headers.get("content-type", "").startswith("text/event-stream")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("change, param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_refused(server, change, param, stream):
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 4, "stream": stream,
            **change}
    if body["model"] is None:
        del body["model"]
    if "stream_options" in change and isinstance(body["stream"], bool):
        body["stream"] = True
    _assert_refused(httpx.post(f"{server.url}/v1/completions", json=body,
                               headers=server.headers), param)


@pytest.mark.parametrize("change, param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_refused(server, change, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True, **change}
    _assert_refused(httpx.post(f"{server.url}/v1/chat/completions", json=body,
                               headers=server.headers), param)


def test_stream_options_without_stream_refused(server):
    body = {"model": MODEL_NAME, "prompt": "a", "stream_options": {"include_usage": True}}
    _assert_refused(httpx.post(f"{server.url}/v1/completions", json=body,
                               headers=server.headers), "stream_options")


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"", "JSON object"),          # no body at all
])
def test_malformed_body_refused(server, content, message):
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert message in _assert_refused(response, None)["message"]


def test_oversized_body_is_413(server):
    body = {"model": MODEL_NAME, "prompt": "x" * (100 * 1024), "stream": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
    _assert_refused(response, None, status=413)


def test_server_keeps_serving_after_refusals(server, client):
    before = server.metrics()
    for change, _ in BAD_COMPLETIONS[:5]:
        httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                   json={"model": MODEL_NAME, "prompt": "a", **change})
    after = server.metrics()
    assert after['specjax_requests_rejected_total{status="400"}'] == \
        before.get('specjax_requests_rejected_total{status="400"}', 0) + 5
    out = client.completions.create(model=MODEL_NAME, prompt=REFERENCE_PROMPTS[0],
                                    temperature=0, max_tokens=REFERENCE_MAX_TOKENS)
    assert out.choices[0].text == server.reference[REFERENCE_PROMPTS[0]].text


# -- auth ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": f"Bearer {API_KEY}x"}],
                         ids=["missing", "wrong", "no-scheme", "basic", "longer"])
@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"),
                                          ("GET", "/v1/models"), ("GET", "/metrics")])
def test_auth_required(server, headers, method, path):
    response = httpx.request(method, f"{server.url}{path}", headers=headers,
                             json={"model": MODEL_NAME, "prompt": "a", "stream": True})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


def test_auth_with_openai_client(server):
    bad = openai.OpenAI(api_key="nope", base_url=f"{server.url}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)
    assert httpx.get(f"{server.url}/health").status_code == 200   # open for probes


# -- overload and failures --------------------------------------------------------------------

def test_full_queue_is_429_before_any_stream(server):
    thread = server.server.engine_thread
    thread.max_queue, saved = 0, thread.max_queue
    try:
        for stream in (True, False):
            response = httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                                  json={"model": MODEL_NAME, "prompt": "a", "stream": stream})
            assert response.status_code == 429
            assert not response.headers["content-type"].startswith("text/event-stream")
            assert response.json()["error"]["code"] == "queue_full"
    finally:
        thread.max_queue = saved


def test_failed_step_is_a_generic_500_and_serving_goes_on(server, client, monkeypatch):
    engine = server.llm.engine
    real_step, failures = engine.step, []

    def failing_step():
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("injected failure: secret internals")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    thread = server.server.engine_thread
    thread.errors.clear()  # the shared server's earlier tests may have left theirs
    try:
        response = httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                              json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 3})
        assert response.status_code == 500
        assert "secret" not in response.text and "Traceback" not in response.text
        assert response.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers,
                          json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 3,
                                "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0][len("data: "):])["error"]["type"] == "server_error"
        assert events[-1] == "data: [DONE]" and "secret" not in "".join(events)
        assert len(thread.errors) == 2 and "injected" in str(thread.errors[0])
    finally:
        monkeypatch.undo()
        thread.errors.clear()
    out = client.completions.create(model=MODEL_NAME, prompt=REFERENCE_PROMPTS[0],
                                    temperature=0, max_tokens=REFERENCE_MAX_TOKENS)
    assert out.choices[0].text == server.reference[REFERENCE_PROMPTS[0]].text
    assert server.metrics()['specjax_requests_total{outcome="error"}'] == 2


def test_unknown_route_has_openai_error_body(server):
    response = httpx.get(f"{server.url}/v1/nothing", headers=server.headers)
    assert response.status_code == 404 and "error" in response.json()


def test_metrics_report_tokens_and_speculation(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=7, temperature=0)
    m = server.wait_idle()
    assert m["specjax_generation_tokens_total"] == before["specjax_generation_tokens_total"] + 7
    assert m["specjax_prompt_tokens_total"] == \
        before["specjax_prompt_tokens_total"] + len(server.tokenizer.encode("a", add_bos=True))
    assert m["specjax_kv_blocks_total"] == server.llm.engine.allocator.total_blocks
    # Draft-target is on: drafts were verified, so acceptance figures are real numbers.
    assert m["specjax_spec_acceptance_length"] >= 1.0
    assert 0.0 <= m["specjax_spec_acceptance_rate"] <= 1.0
    # AR_k per draft position verified (D <= 2 here: the cost model picks 1 or 2 or none):
    # non-increasing, and AL = 1 + sum of AR_k.
    keys = [f'specjax_spec_acceptance_per_position{{position="{k}"}}' for k in (1, 2)]
    per_position = [m[key] for key in keys if key in m]
    assert per_position and all(1.0 >= a >= b >= 0.0
                                for a, b in zip(per_position, per_position[1:] + [0.0]))
    assert m["specjax_spec_acceptance_length"] == pytest.approx(1 + sum(per_position))
    assert 'specjax_spec_acceptance_per_position{position="3"}' not in m
    assert m["specjax_spec_draft_overhead"] >= 0.0
    # The cost model: warm-up timed every compiled generation shape (batch buckets 1, 2, 4 x
    # run widths 1..3 for D = 0..2), and every step ran at a length it chose.
    costs = {k: v for k, v in m.items() if k.startswith("specjax_step_cost_seconds{")}
    assert len(costs) == 9 and all(v > 0 for v in costs.values()), costs
    steps = sum(v for k, v in m.items() if k.startswith("specjax_spec_steps_by_draft_length{"))
    assert steps > 0
    assert (m["specjax_spec_proposed_tokens"] >= m["specjax_spec_verified_tokens"]
            >= m["specjax_spec_accepted_tokens"] >= 0)
    assert m["specjax_time_to_first_token_seconds_count"] >= 1
    assert m["specjax_preemptions"] >= 0 and m["specjax_engine_failed_requests"] >= 0


# -- fault isolation ----------------------------------------------------------------------------

BAD_PROMPT = [11, 12, 13, 14]


def test_engine_error_fails_that_request_alone(server, client, monkeypatch):
    """The engine ends one request with finish_reason "error": it gets an error, not a
    finish_reason; the request running beside it is untouched."""
    engine = server.llm.engine
    monkeypatch.setattr(engine, "step",
                        failing_prompt_step(engine, BAD_PROMPT, "injected: device secret"))
    before = server.metrics().get('specjax_requests_total{outcome="error"}', 0)
    good: dict = {}
    beside = threading.Thread(target=lambda: good.update(out=client.completions.create(
        model=MODEL_NAME, prompt=REFERENCE_PROMPTS[0], temperature=0,
        max_tokens=REFERENCE_MAX_TOKENS)))
    beside.start()
    body = {"model": MODEL_NAME, "prompt": BAD_PROMPT, "max_tokens": 20}
    whole = httpx.post(f"{server.url}/v1/completions", headers=server.headers, json=body)
    assert whole.status_code == 500, whole.text
    assert whole.json()["error"]["type"] == "server_error"
    assert "secret" not in whole.text
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers,
                      json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        events = [line[len("data: "):] for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    reasons = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert set(reasons) <= {None} and "secret" not in "".join(events)
    beside.join(60)
    assert good["out"].choices[0].text == server.reference[REFERENCE_PROMPTS[0]].text
    monkeypatch.undo()
    after = server.wait_idle()
    assert after['specjax_requests_total{outcome="error"}'] == before + 2


SURROGATES = [
    ("/v1/completions", '"prompt": "ab\\ud800cd"', "prompt"),
    ("/v1/completions", '"prompt": ["ab\\udfffcd"]', "prompt"),
    ("/v1/completions", '"prompt": "a", "stop": ["x", "y\\ud800"]', "stop"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800"}]',
     "messages[0].content"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "ok"}, {"role": '
     '"user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": '
     '"\\udc00"}]}]', "messages[1].content[1].text"),
]


@pytest.mark.parametrize("path, fields, param", SURROGATES, ids=[p for *_, p in SURROGATES])
def test_lone_surrogates_are_400(server, path, fields, param, caplog):
    body = f'{{"model": "{MODEL_NAME}", "max_tokens": 2, {fields}}}'.encode()
    with caplog.at_level(logging.ERROR):
        response = httpx.post(f"{server.url}{path}", content=body,
                              headers={**server.headers, "Content-Type": "application/json"})
    error = _assert_refused(response, param)
    assert "surrogate" in error["message"]
    assert not caplog.records        # refused, not crashed


@pytest.mark.parametrize("fields, expected", [
    ('"model": "\\ud800"', "\\ud800"),             # echoed, escaped
    (f'"model": "{MODEL_NAME}", "x\\ud800": 1', "surrogate"),   # a key pydantic refuses
])
def test_surrogates_in_echoed_input_are_escaped(server, fields, expected):
    response = httpx.post(f"{server.url}/v1/completions", content=(
        f'{{"prompt": "a", {fields}}}').encode(), headers={**server.headers,
                                                      "Content-Type": "application/json"})
    assert response.status_code == 400 and expected in response.json()["error"]["message"]


def test_output_must_fit_in_the_context(server):
    max_len = server.server.max_len
    prompt = list(range(1, 101))
    for path, body, param in [
            ("/v1/completions", {"prompt": prompt, "max_tokens": 50}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 60}],
                                      "max_completion_tokens": 90}, "max_completion_tokens")]:
        response = httpx.post(f"{server.url}{path}", headers=server.headers,
                              json={"model": MODEL_NAME, **body})
        message = _assert_refused(response, param)["message"]
        requested = body.get("max_tokens") or body["max_completion_tokens"]
        assert str(requested) in message and str(max_len) in message
    assert "100 tokens" in httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                                      json={"model": MODEL_NAME, "prompt": prompt,
                                            "max_tokens": 50}).json()["error"]["message"]


def test_default_output_length_is_cut_to_the_room_left(server, client):
    max_len = server.server.max_len
    out = client.completions.create(model=MODEL_NAME, prompt=list(range(1, max_len - 5)))
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    words = 1
    while len(server.tokenizer.encode(f"user: {'x ' * (words + 1)}\nassistant: ",
                                      add_bos=True)) < max_len - 3:
        words += 1
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0,
                                          messages=[{"role": "user", "content": "x " * words}])
    assert chat.usage.total_tokens == max_len and chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body", [
    {"model": "m" * 60_000, "prompt": "a"},
    {"model": MODEL_NAME, "prompt": "a", "f" * 60_000: 1},
    {"model": MODEL_NAME, "prompt": [{"text": "x" * 60_000}]},
    {"model": MODEL_NAME, "prompt": "a", "logit_bias": {str(i): 1 for i in range(5000)}},
], ids=["model", "unknown-field", "bad-type", "unsupported"])
def test_errors_never_echo_unbounded_input(server, body):
    response = httpx.post(f"{server.url}/v1/completions", headers=server.headers, json=body)
    assert response.status_code == 400 and len(response.content) < 600, response.text[:300]


def test_errors_never_become_finish_reasons():
    from specjax.engine.request import RequestOutput, RequestStats
    from specjax.serve.protocol import finish_reason
    out = lambda reason: RequestOutput(0, [1], [2], "", reason, RequestStats())
    assert [finish_reason(out(r)) for r in ("stop", "length", "abort", "error", None)] == \
        ["stop", "length", None, None, None]


def test_head_health(server):
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_a_crash_closes_its_connection_so_the_next_request_is_not_lost(server, monkeypatch):
    """An unhandled error is a 500 that says `Connection: close` (uvicorn closes it after
    Starlette re-raises); a keep-alive client then opens a new connection for its next
    request instead of sending it into a closed socket."""
    def broken():
        raise RuntimeError("injected crash")

    monkeypatch.setattr(server.server, "models", broken)
    with httpx.Client(base_url=server.url, headers=server.headers,
                      limits=httpx.Limits(max_connections=1)) as http:
        for _ in range(20):
            crashed = http.get("/v1/models")
            assert crashed.status_code == 500 and crashed.headers["connection"] == "close"
            assert http.get("/health").status_code == 200
