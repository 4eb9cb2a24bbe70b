"""The output processor finds stop strings in incrementally decoded text exactly where a
search of the whole decoded output would, and stops at the first stop condition; a run
appended at once ends where token-by-token appending would; a request's output is a
snapshot that later tokens do not change."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax import SamplingParams
from specjax.engine.output import OutputProcessor
from specjax.engine.request import Request
from specjax.engine.stats import EngineStats
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.tokenizer import Tokenizer

TEXT = ("def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n    out = []\n"
        "    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
        "    return out + a + b  # naïve → ✓\n\n\nclass Stack:\n    pass\n")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(CHECKPOINTS_DIR / BUNDLED_TARGET)


def _run(tokenizer, ids, params, eos=()):
    """Feed `ids` a step at a time (steps of 1-3 tokens, as accepted runs arrive) ->
    (request, finish reason)."""
    processor = OutputProcessor(eos, tokenizer, EngineStats())
    request = Request(0, [1], params, seed=0, max_len=10**6)
    rng = np.random.default_rng(len(ids))
    i, reason = 0, None
    while i < len(ids) and reason is None:
        n = int(rng.integers(1, 4))
        reason = processor.append(request, ids[i:i + n])
        i += n
    if reason is not None:
        processor.finish(request)
    return request, reason


def _expected(tokenizer, ids, stops):
    """The first prefix of `ids` whose full decode contains a stop string, and the text cut at
    the earliest one -- the quadratic definition."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return k, text[:min(hits)]
    return None, None


def test_stop_strings_match_whole_text_search(tokenizer):
    ids = tokenizer.encode(TEXT)
    rng = np.random.default_rng(0)
    text = tokenizer.decode(ids)
    cases = [["\n\n"], ["return"], ["✓"], ["b.pop", "a.pop"], ["Stack", "\n\n\n"],
             ["not in the text"], ['"""M'], ["):\n    "]]
    for _ in range(12):  # random substrings, some spanning token boundaries
        start = int(rng.integers(0, len(text) - 6))
        cases.append([text[start:start + int(rng.integers(1, 7))]])
    hit_cases = 0
    for stops in cases:
        request, reason = _run(tokenizer, ids, SamplingParams(max_tokens=10**4, stop=stops))
        k, cut = _expected(tokenizer, ids, stops)
        if k is None:
            assert reason is None, stops
            continue
        hit_cases += 1
        assert reason == "stop", stops
        assert request.output_ids == ids[:k], stops   # stopped at the completing token
        assert request.text == cut, stops
    assert hit_cases >= 10


def test_first_stop_condition_wins_and_text_is_decoded(tokenizer):
    ids = tokenizer.encode(TEXT)
    eos = ids[5]
    request, reason = _run(tokenizer, ids, SamplingParams(max_tokens=10**4, stop=["Stack"]),
                           eos=(eos,))
    assert reason == "stop" and request.output_ids == ids[:6]
    assert request.text == tokenizer.decode(ids[:6])  # EOS: the whole output, decoded
    params = SamplingParams(max_tokens=10**4, stop=["Stack"], ignore_eos=True,
                            stop_token_ids=(ids[9],))
    request, reason = _run(tokenizer, ids, params, eos=(eos,))
    assert reason == "stop" and request.output_ids == ids[:10]


def test_a_run_appended_at_once_ends_where_token_by_token_would():
    """The common request (no grammar, logprobs or stop strings) takes a step's run at once;
    a request with logprobs goes token by token. Both must keep the same tokens and give the
    same finish reason, for any run, EOS and stop ids, ignore_eos and length limit."""
    rng = np.random.default_rng(0)
    for case in range(400):
        params = SamplingParams(max_tokens=64, ignore_eos=bool(rng.integers(2)),
                                stop_token_ids=[2] if rng.integers(2) else [])
        max_len = int(rng.integers(2, 12))
        fast, slow = (Request(0, [5], params, seed=0, max_len=max_len) for _ in range(2))
        slow.logprobs = []   # the token-by-token path
        processors = [OutputProcessor((1,), None, EngineStats()) for _ in range(2)]
        while True:
            run = rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
            got = processors[0].append(fast, run)
            want = processors[1].append(slow, run, [{}] * len(run))
            assert (got, fast.output_ids) == (want, slow.output_ids), case
            assert fast.stats.num_generated_tokens == len(fast.output_ids)
            if got is not None:
                break
        assert processors[0].stats.num_generated_tokens == len(fast.output_ids)


def test_an_output_is_a_snapshot_of_the_request():
    request = Request(0, [1, 2], SamplingParams(max_tokens=8, logprobs=1), seed=0, max_len=10)
    request.output_ids.append(5)
    request.logprobs.append({5: -0.5})
    early = request.output()
    request.output_ids += [6, 7]
    request.logprobs += [{6: -1.0}, {7: -1.5}]
    late = request.output()
    request.output_ids.append(8)
    assert late.token_ids_from(1) == [6, 7] and early.token_ids_from(0) == [5]
    assert (early.token_ids, early.logprobs) == ([5], [{5: -0.5}])
    assert late.token_ids == [5, 6, 7] and len(late.logprobs) == 3
    assert early.prompt_token_ids == [1, 2]
    assert dataclasses.replace(early, finish_reason="stop").token_ids == [5]
    assert late == dataclasses.replace(late) and late != early
    assert late.token_ids_from(2) == [7]   # after token_ids was read too
