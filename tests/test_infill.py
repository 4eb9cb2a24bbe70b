"""specjax.infill: llama.cpp's fill-in-the-middle layout for Qwen2.5-Coder's tokens, found by
their text; its budget (the prefix keeps its end, the suffix its start, the extra context its
end, the same whatever the output length); the end-of-generation ids; a vocabulary without
the tokens. Tokenizer work only: no model."""
from __future__ import annotations

import pytest

from specjax.infill import FimFormat
from specjax.sampling_params import SamplingParams
from specjax.validation import InvalidArgument
from tests.fim_tokens import BUNDLED_VOCAB, added_special_tokenizer

PRE, MID, SUF, PAD, REPO, SEP = range(BUNDLED_VOCAB, BUNDLED_VOCAB + 6)
END = 0   # <|endoftext|>
EXTRA = [("geo.py", "PI = 3.14\n"), ("util.py", "import math\n")]


@pytest.fixture(scope="module")
def fim(fim_tokenizer) -> FimFormat:
    return FimFormat(fim_tokenizer)


def test_layout_is_llama_cpps(fim, fim_tokenizer):
    enc = fim_tokenizer.encode   # none of these texts spells a special token
    r = fim.render("def area(r):\n", "\n    return a\n", EXTRA, "    a = ", max_len=512,
                   n_predict=16)
    assert r.ids == ([REPO] + enc("myproject\n") + [SEP] + enc("geo.py\n") + enc("PI = 3.14\n")
                     + [SEP] + enc("util.py\n") + enc("import math\n") + [SEP]
                     + enc("filename\n") + [PRE] + enc("def area(r):\n") + enc("    a = ")
                     + [SUF] + enc("\n    return a\n") + [MID])
    assert fim_tokenizer.decode(r.ids, skip_special_tokens=False) == (
        "<|repo_name|>myproject\n<|file_sep|>geo.py\nPI = 3.14\n<|file_sep|>util.py\n"
        "import math\n<|file_sep|>filename\n<|fim_prefix|>def area(r):\n    a = "
        "<|fim_suffix|>\n    return a\n<|fim_middle|>")
    assert not r.truncated
    # Without extra chunks llama.cpp still writes the repository and current-file lines.
    assert fim.render("a", "b", max_len=512).ids == (
        [REPO] + enc("myproject\n") + [SEP] + enc("filename\n") + [PRE] + enc("a") + [SUF]
        + enc("b") + [MID])


def test_file_text_stays_text_and_the_prompt_is_parsed(fim, fim_tokenizer):
    source = "s = '<|endoftext|><|fim_middle|>'\n"
    r = fim.render(source, "", [("t.py", source)], "<|file_sep|>", max_len=512)
    assert END not in r.ids and r.ids.count(MID) == 1 and r.ids[-1] == MID
    pre, suf = r.ids.index(PRE), r.ids.index(SUF)
    assert r.ids[suf - 1] == SEP    # the prompt, parsed as any prompt is
    assert fim_tokenizer.decode(r.ids[pre + 1:suf - 1], skip_special_tokens=False) == source


def test_bos_and_the_layout_without_repo_and_file_tokens():
    with_bos = FimFormat(added_special_tokenizer(add_bos=True))
    ids = with_bos.render("x", "y", EXTRA, max_len=512).ids
    assert ids[ids.index(PRE) - 1] == 0 and ids.count(0) == 1   # BOS between extra and prefix
    three = added_special_tokenizer(("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))
    fim = FimFormat(three)
    snippet = three.encode("\n\n--- snippet ---\n\n")
    assert fim.render("x", "y", EXTRA, max_len=512).ids == (
        snippet + three.encode("PI = 3.14\n") + snippet + three.encode("import math\n")
        + [BUNDLED_VOCAB] + three.encode("x") + [BUNDLED_VOCAB + 2] + three.encode("y")
        + [BUNDLED_VOCAB + 1])
    assert fim.end_ids == (END,)


def test_end_ids_join_the_request_stops(fim):
    assert fim.end_ids == (PAD, REPO, SEP, END)
    params = fim.with_end_ids(SamplingParams(stop_token_ids=(7, SEP)))
    assert params.stop_token_ids == (7, SEP, PAD, REPO, END)


def test_budget_keeps_the_prefix_end_the_suffix_start_and_a_stable_extra(fim):
    prefix = "".join(f"a{i} = {i}\n" for i in range(100))
    suffix = "".join(f"b{i} = {i}\n" for i in range(100))
    extra = [("x.py", "".join(f"c{i} = {i}\n" for i in range(100)))]
    whole = fim.render(prefix, suffix, extra, max_len=1 << 20).ids
    full_context = whole[:whole.index(PRE)]

    def parts(ids):
        pre, suf = ids.index(PRE), ids.index(SUF)
        return ids[:pre], ids[pre + 1:suf], ids[suf + 1:-1]

    r = fim.render(prefix, suffix, extra, max_len=128, n_predict=8)
    assert r.truncated and len(r.ids) <= 128 - 8
    context, before, after = parts(r.ids)
    assert before == fim.text_ids(prefix)[-len(before):]
    assert after == fim.text_ids(suffix)[:len(after)]
    assert context == full_context[-len(context):]
    # n_batch = min(2048, 128 // 4) = 32: the prefix keeps 3/4 of it (24), the suffix 1/4 - 2
    # (6), the extra context 128 - 2 x 32 (64); 32 are left for the output.
    assert (len(context), len(before), len(after)) == (64, 24, 6)
    # A warm-up (nothing to generate) renders the very same tokens: its blocks are shared.
    assert fim.render(prefix, suffix, extra, max_len=128, n_predict=0).ids == r.ids
    # A longer output than that room comes off the suffix's end first (the cached extra
    # context and prefix before it stay), then the prefix's start.
    long = fim.render(prefix, suffix, extra, max_len=128, n_predict=34)  # 3 over
    assert parts(long.ids)[:2] == (context, before) and len(parts(long.ids)[2]) == 3
    longer = parts(fim.render(prefix, suffix, extra, max_len=128, n_predict=56).ids)  # 25
    assert longer[0] == context and longer[1] == before[-5:] and longer[2] == []
    with pytest.raises(InvalidArgument, match="exceeds the context of 128") as e:
        fim.render("", "", prompt="x = 1\n" * 100, max_len=128, n_predict=8, param="prompt")
    assert e.value.param == "prompt"


def test_a_vocabulary_without_fim_tokens_is_refused_by_name():
    tokenizer = added_special_tokenizer(("<|fim_pad|>",))
    # The same texts as plain added tokens do not count: only special tokens do.
    tokenizer.backend.add_tokens(["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    fim = FimFormat(tokenizer)
    assert fim.missing == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    with pytest.raises(InvalidArgument) as e:
        fim.render("a", "b", max_len=512, param="suffix")
    assert e.value.param == "suffix"
    assert all(t in str(e.value) for t in fim.missing)
