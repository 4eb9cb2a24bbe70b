"""The output processor finds stop strings in incrementally decoded text exactly where a
search of the whole decoded output would, and stops at the first stop condition."""
from __future__ import annotations

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
