"""Greedy output through the paged engine equals transformers' greedy `generate`."""
import pytest

torch = pytest.importorskip("torch")

import specjax  # noqa: E402
from specjax import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 3, 88, 41, 9, 2], [60], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.mark.parametrize("family", ["llama3", "qwen2_bias", "qwen3_qknorm_tied", "mistral_window",
                                    "bamba"])
def test_engine_greedy_equals_transformers_generate(hf_checkpoint, family):
    folder, hf = hf_checkpoint(family)
    llm = specjax.LLM(str(folder), dtype="float32", max_batch_size=2, max_prefill_rows=1,
                      tokens_per_block=4, prefill_chunk=8, max_model_len=64, progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), family
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
