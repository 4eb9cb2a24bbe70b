"""Reading a drafter module, shared by the loaders each worker module registers
(`registry.register(mode, load)`): a folder path (or a shipped name) is read in the target's
dtype, a GGUF file in its own format, an instance is taken as it is, and either is checked
against the target."""
from __future__ import annotations

from typing import Any, Callable

from specjax.models import Llama
from specjax.models.config import ModelConfig
from specjax.models.gguf_checkpoint import is_gguf
from specjax.models.linear import activation_bits, with_activation_bits
from specjax.models.registry import load_model, resolve_model_path


def read_llama(draft: Any, dtype: str, target: Llama) -> Llama:
    """A drafter that is a causal LM (draft-target, PARD). A GGUF's quantized weights stay
    quantized: in the target's float32 a drafter is read at 4-7x its file's bytes every
    draft step, and held so (Qwen2.5-Coder's 0.5B: 2 GB for a 491 MB file). They are
    multiplied against x rounded as the target's are (`LLM(activation_bits=)`): a drafter's
    rounding moves acceptance, never the output, but 8 bits lost there (the 0.5B drafting for
    the 1.5B on a Zen 4 EPYC: AL 3.34 -> 2.24, decode 1.09x -> 0.94x), so it is not forced."""
    if not isinstance(draft, Llama):
        path = resolve_model_path(draft)
        draft = load_model(path, dtype=None if is_gguf(path) else dtype)
    return with_activation_bits(draft, activation_bits(target))


def read_head(draft: Any, load: Callable[[Any], Any], target: Llama, what: str, missing: str):
    """A hidden-state head (`load(path)` reads its folder), checked against `target`;
    `missing`: the error when the config names none."""
    if draft is None:
        raise ValueError(missing)
    if isinstance(draft, str):
        draft = load(resolve_model_path(draft))
    check_head_matches_target(draft.config.hidden_size, draft.config.vocab_size, target.config,
                              what)
    return draft


def check_head_matches_target(hidden_size: int, vocab_size: int, target: ModelConfig,
                              what: str) -> None:
    if hidden_size != target.hidden_size:
        raise ValueError(f"{what} has hidden_size {hidden_size} but the target's is "
                         f"{target.hidden_size}: it was trained for another target")
    if vocab_size != target.vocab_size:
        raise ValueError(f"{what} has vocab_size {vocab_size} but the target's is "
                         f"{target.vocab_size}: it was trained for another target")
