"""llama.cpp's /infill and /completion, and OpenAI's `suffix`, on a tiny model whose tokenizer
has Qwen2.5-Coder's FIM tokens: greedy output equals `LLM.infill` and `LLM.generate` on the
rendered prompt, a stream adds up to the whole response, an editor's warm-up (n_predict 0)
leaves its prompt in the prefix cache for the next request, bad requests and a model without
FIM tokens are 400s naming the problem; llama.cpp's editor limits (n_indent,
t_max_predict_ms) on their own."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from fakes import FakeEngine, fake_llm
from flax import nnx
from live_server import TINY_SERVE, LiveServer, serve_in_thread

import specjax
from specjax.chat import ChatTemplate
from specjax.engine.request import RequestOutput, RequestStats
from specjax.infill import FimFormat
from specjax.models import Llama
from specjax.serve import ServerSettings, create_app
from specjax.serve.line_limits import LineLimits
from tests.fim_tokens import BUNDLED_VOCAB

MODEL = "tiny-fim"
N = 10   # tokens asked for
CASE = {"input_prefix": "def area(r):\n", "input_suffix": "\n    return a\n",
        "input_extra": [{"filename": "geo.py", "text": "PI = 3.14\n"}], "prompt": "    a = "}
GREEDY = {"n_predict": N, "temperature": 0}


def case_args(case=CASE):
    return (case["input_prefix"], case["input_suffix"],
            [(c["filename"], c["text"]) for c in case.get("input_extra", [])],
            case.get("prompt", ""))


@pytest.fixture(scope="module")
def fim_server(fim_tokenizer):
    # 512 positions: room for the case untruncated (n_batch = 512 // 4, the suffix 1/4 of it)
    model = Llama(TINY_SERVE.replace(vocab_size=BUNDLED_VOCAB + 6, max_position_embeddings=512),
                  rngs=nnx.Rngs(0))
    llm = specjax.LLM(model, tokenizer=fim_tokenizer, max_batch_size=2, tokens_per_block=8,
                      prefill_chunk=16, progress=False, seed=0)
    fim = FimFormat(fim_tokenizer)
    prefix, suffix, extra, prompt = case_args()
    greedy = specjax.SamplingParams(max_tokens=N)
    # The references, before the engine thread owns the engine.
    rendered = fim.render(prefix, suffix, extra, prompt, max_len=llm.engine.max_len,
                          n_predict=N).ids
    [generated] = llm.generate(rendered, fim.with_end_ids(greedy))
    [infilled] = llm.infill(prefix, suffix, extra, greedy, prompt)
    app = create_app(llm, ServerSettings(model_names=(MODEL,), max_tokens_cap=64))
    url, uvicorn_server, thread = serve_in_thread(app)
    live = LiveServer(url, app, llm, fim_tokenizer, {}, uvicorn_server, thread)
    live.fim, live.rendered, live.generated, live.infilled = fim, rendered, generated, infilled
    yield live
    uvicorn_server.should_exit = True
    thread.join(30)


@pytest.fixture
def fim_live(fim_server):
    yield fim_server
    fim_server.wait_idle()   # every KV block back, nothing running
    assert fim_server.server.engine_thread.errors == []


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


def test_infill_greedy_equals_llm_infill_and_generate(fim_live):
    ref = fim_live.generated
    assert fim_live.infilled.token_ids == ref.token_ids and len(ref.token_ids) > 3
    got = post(fim_live, "/infill", {**CASE, **GREEDY, "return_tokens": True}).json()
    assert got["tokens"] == ref.token_ids and got["content"] == ref.text
    assert got["stop"] is True and got["tokens_predicted"] == len(ref.token_ids)
    assert got["tokens_evaluated"] == len(fim_live.rendered) and got["truncated"] is False
    assert got["stop_type"] == ("limit" if ref.finish_reason == "length" else "eos")
    timings = got["timings"]
    assert timings["predicted_n"] == len(ref.token_ids)
    assert timings["prompt_n"] + timings["cache_n"] == len(fim_live.rendered)
    assert all(timings[k] >= 0 for k in ("prompt_ms", "predicted_ms", "predicted_per_second"))
    # llama.cpp's /completion on the rendered ids ends at the same FIM end-of-generation ids.
    same = post(fim_live, "/completion", {"prompt": fim_live.rendered, **GREEDY,
                                          "return_tokens": True}).json()
    assert same["tokens"] == ref.token_ids
    # response_fields: llama.vim's flat "a/b" keys.
    picked = post(fim_live, "/infill", {**CASE, **GREEDY, "response_fields": [
        "content", "timings/predicted_n", "nothing/here"]}).json()
    assert picked == {"content": ref.text, "timings/predicted_n": len(ref.token_ids)}


def test_stream_adds_up_to_the_whole_response(fim_live):
    whole = post(fim_live, "/infill", {**CASE, **GREEDY}).json()
    events = []
    with httpx.stream("POST", f"{fim_live.url}/infill", json={**CASE, **GREEDY, "stream": True},
                      timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ") and line != "data: [DONE]"
                events.append(json.loads(line[len("data: "):]))
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert len(events) > 2 and events[-1]["content"] == ""
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_warm_up_fills_the_prefix_cache_for_the_next_request(fim_live):
    extra = [{"filename": "ring.py", "text": "".join(f"v{i} = {i}\n" for i in range(10))}]
    warm_up = {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
               "n_predict": 0, "temperature": 0.0, "samplers": [], "cache_prompt": True,
               "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "id_slot": 0}
    warm = post(fim_live, "/infill", warm_up).json()
    assert (warm["content"], warm["tokens_predicted"], warm["stop"]) == ("", 0, True)
    assert post(fim_live, "/infill", {**warm_up, "response_fields": [""]}).json() == {}
    fim_live.wait_idle()
    case = {**CASE, "input_extra": extra}
    warm_ids = fim_live.fim.render(*case_args(warm_up), max_len=128).ids
    ids = fim_live.fim.render(*case_args(case), max_len=128, n_predict=N).ids
    shared = next(i for i, (a, b) in enumerate(zip(warm_ids, ids)) if a != b)
    expected = shared // 8 * 8                   # whole blocks of 8 tokens
    assert expected >= 16
    stats = fim_live.llm.engine.stats
    hits = stats.prefix_cache_hits
    got = post(fim_live, "/infill", {**case, **GREEDY}).json()
    assert got["tokens_cached"] == got["timings"]["cache_n"] == expected
    assert stats.prefix_cache_hits - hits == expected


def test_llama_vims_request_is_served_as_sent(fim_live):
    fields = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
              "tokens_cached"]
    extra = [{**chunk, "time": [1733, 5120]} for chunk in CASE["input_extra"]]
    got = post(fim_live, "/infill", {
        "id_slot": 0, **CASE, "input_extra": extra, "n_predict": N, "stop": [], "n_indent": 4,
        "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False,
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
        "response_fields": fields, "model": ""})
    assert got.status_code == 200, got.text
    assert sorted(got.json()) == sorted(fields)


def test_suffix_on_v1_completions_equals_infill(fim_live):
    body = {"input_prefix": "x = [1, 2,", "input_suffix": "]\nprint(x)\n", **GREEDY}
    infill = post(fim_live, "/infill", body).json()
    openai_style = post(fim_live, "/v1/completions", {
        "model": MODEL, "prompt": body["input_prefix"], "suffix": body["input_suffix"],
        "max_tokens": N, "temperature": 0}).json()
    assert openai_style["choices"][0]["text"] == infill["content"]
    assert openai_style["usage"]["completion_tokens"] == infill["tokens_predicted"]


BAD_INFILLS = [
    ({"input_prefix": 5}, "input_prefix"),
    ({"input_suffix": None}, "input_suffix"),
    ({"frobnicate": 1}, "frobnicate"),                       # unknown field
    ({"input_extra": [{"text": "x", "bogus": 1}]}, "input_extra[0].bogus"),
    ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0].text"),
    ({"input_extra": {"text": "x"}}, "input_extra"),
    ({"n_predict": -2}, "n_predict"),
    ({"n_predict": 65}, "n_predict"),                         # the server's cap
    ({"n_predict": 1.5}, "n_predict"),
    ({"samplers": ["top_k", "mirostat"]}, "samplers"),
    ({"repeat_penalty": 1.1}, "repeat_penalty"),              # llama.cpp's window differs
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop": "\n"}, "stop"),                                 # llama.cpp's stop is a list
    ({"model": "gpt-4"}, "model"),
    ({"prompt": "x = 1\n" * 400}, "prompt"),                  # leaves no room
]


@pytest.mark.parametrize("change, param", BAD_INFILLS, ids=[p for _, p in BAD_INFILLS])
def test_bad_infill_refused(fim_server, change, param):
    body = {**CASE, **GREEDY, **change}
    if body["input_suffix"] is None:
        del body["input_suffix"]
    response = post(fim_server, "/infill", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"]


@pytest.mark.parametrize("change, param", [
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": [BUNDLED_VOCAB + 6]}, "prompt"),               # outside the vocabulary
    ({"prompt": "x = 1\n" * 120, "n_predict": 64}, "n_predict"),  # past the context
], ids=["type", "vocabulary", "room"])
def test_bad_completion_refused(fim_server, change, param):
    response = post(fim_server, "/completion", {"prompt": "a", **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_model_without_fim_tokens_is_a_400_naming_them(bundled_tokenizer):
    engine = FakeEngine(tokenizer=bundled_tokenizer)
    app = create_app(fake_llm(bundled_tokenizer, engine), ServerSettings(model_names=("fake",)),
                     ChatTemplate())
    url, uvicorn_server, thread = serve_in_thread(app)
    try:
        response = httpx.post(f"{url}/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert all(t in message for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
        response = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "a",
                                                            "suffix": "b"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
        assert engine.added == []            # refused before any work
        done = httpx.post(f"{url}/completion", json={"prompt": "a", "n_predict": 3}).json()
        assert done["tokens_predicted"] == 3 and done["stop_type"] == "limit"
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)


def _outputs(tokenizer, text: str, started: float):
    """The cumulative outputs of a request generating `text` one token a step."""
    ids, stats = tokenizer.encode(text), RequestStats(first_token_time=started)
    return [RequestOutput(0, [1], ids[:i], "", None, stats) for i in range(1, len(ids) + 1)]


def test_n_indent_ends_before_the_first_line_indented_less(fim_tokenizer):
    text = "x = 1\n    y = 2\n\t   w\n  z = 3\n    q\n"
    check = LineLimits(n_indent=4).start(fim_tokenizer)
    cuts = [check(out) for out in _outputs(fim_tokenizer, text, time.perf_counter())]
    first = next(i for i, c in enumerate(cuts) if c is not None)
    # The line "  z" ends it once its "z" is in: its newline and indentation stay, as in
    # llama.cpp; "\t   w" is indented by 4 (tabs count one, as there).
    assert cuts[first].text == "x = 1\n    y = 2\n\t   w\n  "
    assert cuts[first].finish_reason == "length"
    assert LineLimits().start(fim_tokenizer) is None


def test_t_max_predict_ms_ends_after_a_newline_once_the_time_is_up(fim_tokenizer):
    check = LineLimits(t_max_predict_ms=5).start(fim_tokenizer)
    outs = _outputs(fim_tokenizer, "a = 1\nb = 2", time.perf_counter() - 1.0)
    cuts = [check(out) for out in outs]
    newline = next(i for i, o in enumerate(outs)
                   if "\n" in fim_tokenizer.decode(o.token_ids))
    # The first output after the one with the newline ends it, keeping all its text.
    assert cuts[:newline + 1] == [None] * (newline + 1)
    assert cuts[newline + 1].text == fim_tokenizer.decode(outs[newline + 1].token_ids)
