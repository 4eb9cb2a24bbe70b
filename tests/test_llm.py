"""The public API: argument errors name the argument and come before any work."""
import pytest

import specjax
from specjax import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=-1), "max_tokens must be >= 1"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(max_tokens=2.5), "max_tokens must be an int"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a number"),
    (dict(top_k=-2), r"top_k must be in \[0, 2\*\*31-1\] \(int32 on the device\)"),
    # Each value written to a device array is bounded by that array's dtype too.
    (dict(top_k=2**31), r"top_k must be in \[0, 2\*\*31-1\].*got 2147483648"),
    (dict(max_tokens=2**31), r"max_tokens must be in \[1, 2\*\*31-1\]"),
    (dict(temperature=1e-9), r"temperature must be 0 or in \[1e-05, 10000\]"),
    (dict(temperature=float("inf")), r"temperature must be 0 or in \[1e-05, 10000\]"),
    (dict(top_p=1e-40), r"top_p must be in \[1.17549e-38, 1\] \(float32"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*32-1\] \(uint32"),
    (dict(seed=2**40), r"seed must be in \[0, 2\*\*32-1\]"),
    (dict(stop=[""]), "stop must hold non-empty strings"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be >= 0"),
])
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_folder(tmp_path):
    with pytest.raises(ValueError, match="neither a known name nor an existing local folder"):
        specjax.LLM(str(tmp_path / "missing"))


def test_engine_config_errors(tiny_model):
    with pytest.raises(ValueError, match="max_batch_size"):
        specjax.LLM(tiny_model, max_batch_size=0, warmup=False)
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds"):
        specjax.LLM(tiny_model, max_model_len=4096, warmup=False)
    with pytest.raises(ValueError, match="num_kv_blocks 3 cannot hold one request"):
        specjax.LLM(tiny_model, num_kv_blocks=3, warmup=False)


def test_text_prompt_without_tokenizer(tiny_llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny_llm.generate("hello")


def test_mismatched_params_list(tiny_llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        tiny_llm.generate([[1], [2]], [SamplingParams()])


def test_outputs_in_prompt_order_with_stats(tiny_llm):
    outs = tiny_llm.generate([[1, 2, 3], [5]], [SamplingParams(max_tokens=4),
                                                  SamplingParams(max_tokens=2)])
    assert [len(o.token_ids) for o in outs] == [4, 2]
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [5]]
    assert outs[0].stats.decoding_iterations == 4
    assert outs[0].stats.first_token_time <= outs[0].stats.finish_time


def test_follow_and_close_belong_to_multi_process_jobs(tiny_llm):
    """One process: nothing to follow (an error naming it), nothing to close (a no-op)."""
    with pytest.raises(RuntimeError, match="follow\\(\\) is for processes other than 0"):
        tiny_llm.follow()
    tiny_llm.close()
    assert tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
