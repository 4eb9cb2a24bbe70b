"""Which tokens a choice reports (their logprobs), streamed or whole: a token is reported once
text beyond its start was sent; at the finish every remaining one is, unless a stop string cut
the text, when only those starting before the cut are. The streamed entries add up to the
whole response's, however the outputs are split into events."""
from __future__ import annotations

import random

import pytest
from fakes import fake_logprobs

from specjax.engine.request import RequestOutput, RequestStats
from specjax.serve.choices import ChoiceStream, Echo, prompt_offsets
from specjax.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs


class PieceTokenizer:
    PIECES = ["a", "b", "\n", "x", "END", ""]    # 5: a token with no text (like EOS)

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


def _outputs(tokens, final_text, reason="stop", prompt=(1,), k=1, cuts=None):
    """Cumulative outputs ending with the final one; `cuts`: the lengths of the earlier
    events."""
    lps = [fake_logprobs(t, k) for t in tokens]
    prompt_lps = [None] + [fake_logprobs(t, k) for t in prompt[1:]]
    mk = lambda n, done: RequestOutput(0, list(prompt), list(tokens[:n]),
                                       final_text if done else "", reason if done else None,
                                       RequestStats(), None, lps[:n], prompt_lps)
    return [mk(n, False) for n in (cuts or [])] + [mk(len(tokens), True)]


def _run(tokenizer, outputs, stops=(), echo=None):
    cs = ChoiceStream(0, tokenizer, stops, logprobs=True, echo=echo)
    text, entries, steps = "", [], []
    for out in outputs:
        delta, new = cs.update(out)
        text += delta
        entries += new
        steps.append((text, list(new)))
    return text, entries, steps


def test_stop_string_cut_drops_the_tokens_after_the_cut():
    tokens = [0, 1, 2, 3, 2, 2, 0]     # "ab\nx\n\na": the stop "\n\n" starts at 4
    text, entries, _ = _run(PieceTokenizer(), _outputs(tokens, "ab\nx"), stops=["\n\n"])
    assert text == "ab\nx"
    assert [e.token for e in entries] == [0, 1, 2, 3]
    assert [e.offset for e in entries] == [0, 1, 2, 3]
    assert entries[1].logprob == fake_logprobs(1, 1)[1]


def test_a_stop_string_inside_a_token_keeps_that_token():
    # "END" is one token; the stop "ND" starts inside it: its text is partly in the choice.
    text, entries, _ = _run(PieceTokenizer(), _outputs([0, 4, 1], "aE"), stops=["ND"])
    assert text == "aE" and [e.token for e in entries] == [0, 4]


def test_without_a_cut_every_token_is_reported_including_textless_ones():
    text, entries, _ = _run(PieceTokenizer(), _outputs([0, 1, 5], "ab", reason="stop"))
    assert text == "ab" and [e.token for e in entries] == [0, 1, 5]
    assert entries[2].offset == 2


def test_held_text_holds_its_tokens_back():
    tokens = [0, 2, 3]                  # "a\nx": "\n" may start "\n\n"
    _, _, steps = _run(PieceTokenizer(), _outputs(tokens, "a\nx", reason="length",
                                                  cuts=[1, 2]), stops=["\n\n"])
    assert steps[0] == ("a", steps[0][1]) and [e.token for e in steps[0][1]] == [0]
    assert steps[1][0] == "a" and steps[1][1] == []          # "\n" held, its token too
    assert [e.token for e in steps[2][1]] == [2, 3]


def _random_cuts(rng, n):
    return sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []


@pytest.mark.parametrize("seed", range(8))
def test_streamed_entries_equal_the_whole_response(bundled_tokenizer, seed):
    """Split characters, stop strings cut or not, echo: any split into events gives the
    same text and the same entries as one final event."""
    rng = random.Random(seed)
    text = "naïve → 中文 ok ✓ done\n\nmore 日本 text"
    tokens = bundled_tokenizer.encode(text)
    stops = [["\n\n"], ["ok ✓"], ["zzz"], []][seed % 4]
    cut = -1
    for i in range(len(tokens)):   # as the engine does: the output ends where a stop is
        full = bundled_tokenizer.decode(tokens[:i + 1])
        cut = min([full.find(s) for s in stops if full.find(s) >= 0], default=-1)
        if cut >= 0:
            tokens = tokens[:i + 1]
            break
    final_text = full[:cut] if cut >= 0 else full
    prompt = bundled_tokenizer.encode("日本 x", add_bos=True)
    echo = None
    if seed % 2:
        echo_text = "日本 x"
        echo = Echo(echo_text, prompt_offsets(bundled_tokenizer, prompt, echo_text))
    whole = _run(bundled_tokenizer, _outputs(tokens, final_text, prompt=prompt), stops, echo)
    streamed = _run(bundled_tokenizer, _outputs(tokens, final_text, prompt=prompt,
                                                cuts=_random_cuts(rng, len(tokens))),
                    stops, echo)
    assert whole[0] == streamed[0] == (echo.text if echo else "") + final_text
    assert whole[1] == streamed[1]
    texts = TokenTexts(bundled_tokenizer)
    assert completion_logprobs(whole[1], texts) == completion_logprobs(streamed[1], texts)
    # Every reported token's offset lies in the text sent up to then.
    for sent, new in streamed[2]:
        assert all(e.offset <= len(sent) for e in new)
    # A cut drops the tokens past it; otherwise all are reported.
    generated = [e for e in whole[1][len(prompt) if echo else 0:]]
    if cut >= 0:
        assert len(generated) < len(tokens)
        assert all(e.offset - (len(echo.text) if echo else 0) < len(final_text)
                   for e in generated)
    else:
        assert [e.token for e in generated] == tokens
    if echo:
        assert [e.token for e in whole[1][:len(prompt)]] == prompt
        assert whole[1][0].logprob is None and whole[1][0].top is None


def test_openai_shapes(bundled_tokenizer):
    texts = TokenTexts(bundled_tokenizer)
    ids = bundled_tokenizer.encode("日 a")
    _, entries, _ = _run(bundled_tokenizer, _outputs(ids, bundled_tokenizer.decode(ids), k=2))
    completion = completion_logprobs(entries, texts, shift=3)
    assert completion["tokens"][:3] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5"]
    assert completion["tokens"][3:] == [" a"]
    assert completion["text_offset"] == [3, 3, 3, 4]
    assert len(completion["top_logprobs"][0]) in (2, 3)   # top 2, plus the chosen if outside
    chat = chat_logprobs(entries, texts, top_k=2)["content"]
    assert [bytes(c["bytes"]) for c in chat] == [b"\xe6", b"\x97", b"\xa5", b" a"]
    assert b"".join(bytes(c["bytes"]) for c in chat).decode() == "日 a"
    assert all(len(c["top_logprobs"]) == 2 for c in chat)
    assert chat[1]["logprob"] == fake_logprobs(ids[1], 2)[ids[1]]
    # -inf is not JSON: sent as vLLM does.
    from specjax.serve.logprobs import TokenLogprob
    inf = completion_logprobs([TokenLogprob(1, float("-inf"), ((1, float("-inf")),), 0)], texts)
    assert inf["token_logprobs"] == [-9999.0]
