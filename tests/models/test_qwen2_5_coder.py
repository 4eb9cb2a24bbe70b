"""The real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M: `pip install -e ".[qwen2-5-coder-1-5b]"`; CI
installs it for the slow job and sets SPECJAX_REQUIRE_QWEN=1 so that it cannot skip): the file
by name, its chat template, greedy chat against transformers' own GGUF loader (its answers
stored as data by scripts/greedy_golden.py: running transformers here would cost minutes and
6 GB), fill-in-the-middle, and speculation exact on it. Slow job only."""
import json
import os
from pathlib import Path

import pytest

from specjax.models.registry import installed_model

try:
    PATH = installed_model("qwen2.5-coder-1.5b")
except FileNotFoundError as e:
    if os.environ.get("SPECJAX_REQUIRE_QWEN"):
        raise
    pytest.skip(str(e), allow_module_level=True)

import specjax  # noqa: E402
from specjax.chat import ChatTemplate  # noqa: E402

pytestmark = pytest.mark.slow
GOLDEN = json.loads((Path(__file__).parent / "data" / "qwen2.5-coder-1.5b.json").read_text())
# Where the quantized engine may pick another greedy token than transformers' float32 forward
# of the dequantized file: transformers' top-2 margin below this (the kernel rounds
# activations to 16 bits a block), as for Gemma 3 (test_gemma3_270m.py).
TIE_QUANT = 5e-2
FIM_IDS = {"<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661,
           "<|fim_pad|>": 151662, "<|repo_name|>": 151663, "<|file_sep|>": 151664}


@pytest.fixture(scope="module")
def llm():
    # One batch bucket for every request at once: each program of 28 unrolled layers and a
    # 151,936-token head compiles in tens of seconds here.
    return specjax.LLM("qwen2.5-coder-1.5b", max_batch_size=16, batch_sizes=(16,),
                       max_model_len=512, max_prefill_rows=4, progress=False)


def test_the_file_is_qwen2_5_coder_1_5b(llm):
    cfg, tok = llm.model.config, llm.tokenizer
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == ("qwen2", 28, 1536, 12, 2, 151936)
    # its own Q6_K head beside the Q4_K embedding (this file does not tie them)
    assert cfg.qkv_bias and not cfg.tie_word_embeddings and PATH.stat().st_size == 1_117_320_768
    assert {t: tok.backend.token_to_id(t) for t in FIM_IDS} == FIM_IDS
    # ends at <|im_end|> and <|endoftext|>; its template writes its default system prompt
    assert set(tok.eos_token_ids) == {151645, 151643} and not tok.add_bos_token
    rendered = ChatTemplate.from_tokenizer(tok).render(
        [{"role": "user", "content": "hi"}])
    assert rendered.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_greedy_chat_matches_transformers(llm):
    """16 held-out requests (8 chat, 8 code) x 32 tokens through the chat template, the
    engine at its default (weights kept quantized) against transformers' float32 forward of
    the dequantized file: at least 15 equal whole, a differing one only where transformers'
    own top two are within TIE_QUANT."""
    requests = GOLDEN["requests"]
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in requests],
                    specjax.SamplingParams(max_tokens=GOLDEN["tokens"], temperature=0))
    equal = 0
    for r, out in zip(requests, outs):
        assert out.prompt_token_ids == r["prompt_ids"]
        ours, ref = list(out.token_ids), r["greedy"]
        at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if at is None:
            assert len(ours) == len(ref), (out.text, ours, ref)
            equal += 1
            continue
        print(f"differs at {at}: transformers' top-2 margin {r['margins'][at]:.3f}")
        assert r["margins"][at] < TIE_QUANT, (out.text, at)
    print(f"{equal}/16 greedy continuations equal transformers'")
    assert equal >= 15
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_fill_in_the_middle_on_the_real_file(llm):
    """LLM.infill in llama.cpp's layout, greedy: the gap of a function whose call is below it
    filled with code that runs and computes it (the Instruct model may go on past the gap:
    an editor keeps the first lines), with a file of the repository as extra context; a
    one-line gap ends at an end-of-generation token."""
    params = specjax.SamplingParams(max_tokens=32, temperature=0)
    prefix, suffix = "def mean(values):\n    ", "\n\nprint(mean([1, 2, 3]))\n"
    extra = [("stats.py", "def total(values):\n    return sum(values)\n")]
    [out] = llm.infill(prefix, suffix, extra=extra, sampling_params=params)
    scope = {}
    exec(prefix + out.text.split("\n")[0], scope)
    assert scope["mean"]([1, 2, 6]) == 3, out.text
    ids = out.prompt_token_ids
    assert ids.count(FIM_IDS["<|fim_prefix|>"]) == 1 and ids[-1] == FIM_IDS["<|fim_middle|>"]
    assert llm.tokenizer.decode(ids).count("def total(values):") == 1  # the extra chunk
    [out] = llm.infill("def fib(n):\n    if n < 2:\n        return n\n    return ",
                       "\n\nprint(fib(10))\n", sampling_params=params)
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm._fim.end_ids, out.text
    scope = {}
    exec("def fib(n):\n    if n < 2:\n        return n\n    return " + out.text, scope)
    assert scope["fib"](10) == 55


def test_speculation_is_exact_on_the_real_file(llm):
    """SA drafting (greedy) equals plain decoding token for token on an edit request and a
    chat one; every KV block comes back."""
    drafted = specjax.LLM("qwen2.5-coder-1.5b", max_batch_size=16, batch_sizes=(16,),
                          max_model_len=512, max_prefill_rows=4, progress=False,
                          speculative_config=specjax.SAConfig(max_draft_len=4))
    code = GOLDEN["requests"][8]["prompt"]
    messages = [[{"role": "user", "content": "Rename x to total:\n\ndef f(x):\n    x = x + 1\n"
                                             "    return x * x\n"}],
                [{"role": "user", "content": code}]]
    params = specjax.SamplingParams(max_tokens=32, temperature=0)
    plain = [o.token_ids for o in llm.chat(messages, params)]
    assert [o.token_ids for o in drafted.chat(messages, params)] == plain
    assert drafted.stats.accepted_draft_tokens > 0
    assert drafted.engine.allocator.num_free_blocks == drafted.engine.allocator.total_blocks
