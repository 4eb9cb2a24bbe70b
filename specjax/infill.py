"""Fill-in-the-middle prompts, laid out as llama.cpp's server lays them out (`format_infill`).

The FIM tokens are found in the vocabulary by their text (a Qwen2.5-Coder GGUF names none in
its metadata), special tokens only. With `<|repo_name|>` and `<|file_sep|>` the repo-level
layout is used, each extra chunk a file of its own:

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n
    [BOS]<|fim_prefix|>{prefix}{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

`prompt` (an editor's current line up to the cursor) follows the prefix, as llama.cpp's code
puts it. Without `<|file_sep|>` each chunk starts with a "--- snippet ---" line instead. Prefix,
suffix and extra text are tokenised as plain text, each on its own: a source file that spells
`<|endoftext|>` stays text (llama.cpp's parse_special=false); `prompt` is parsed as a prompt is.

Nothing too long is an error (`FimFormat.render`; only a `prompt` that alone leaves no room
is): with `n_batch` = min(2048, max_len // 4) (llama.cpp's default batch, which bounds its
local context), the prefix keeps its last 3/4 of n_batch, the suffix its first 1/4 - (2 +
prompt) (llama.cpp's shares), the extra context its last max_len - 2 n_batch tokens, n_batch
left for the output: the same cuts whatever the request asks, so an editor's warm-up
(`n_predict` 0) and its next request render the same tokens and share their cached blocks.
A longer output comes off the suffix's end, then the prefix's start, then the extra
context's start.

Generation ends, as llama.cpp's end-of-generation tokens do for these vocabularies, also at
`<|endoftext|>`, `<|fim_pad|>`, `<|repo_name|>` and `<|file_sep|>` (`FimFormat.end_ids`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import tokenizers

from specjax.sampling_params import SamplingParams
from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument

# Qwen2.5-Coder's spelling of each role.
FIM_TEXTS = {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>",
             "middle": "<|fim_middle|>", "pad": "<|fim_pad|>", "repo": "<|repo_name|>",
             "file_sep": "<|file_sep|>"}
REQUIRED = ("prefix", "suffix", "middle")
END_TEXT = "<|endoftext|>"
N_BATCH = 2048                      # llama.cpp's default n_batch
PROJECT = "myproject\n"             # llama.cpp's repository name (its TODO: an input)
CURRENT_FILE = "filename\n"         # and the current file's name
SNIPPET = "\n\n--- snippet ---\n\n"  # a chunk's start without <|file_sep|>
DEFAULT_FILENAME = "tmp"            # a chunk without a filename


@dataclasses.dataclass(frozen=True)
class Rendered:
    ids: list[int]
    truncated: bool   # part of the prefix, suffix or extra context did not fit


class FimFormat:
    """A tokenizer's FIM tokens and the prompts they make; `missing` names the required
    tokens the vocabulary lacks (then `render` raises, naming them)."""

    def __init__(self, tokenizer: Tokenizer):
        special = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
                   if t.special}
        self.tokenizer = tokenizer
        self.ids = {role: special.get(text) for role, text in FIM_TEXTS.items()}
        self.missing = tuple(FIM_TEXTS[r] for r in REQUIRED if self.ids[r] is None)
        ends = [self.ids[r] for r in ("pad", "repo", "file_sep")] + [special.get(END_TEXT)]
        self.end_ids = tuple(i for i in ends if i is not None)
        # A copy that reads special tokens' text as text: the shared one must keep parsing it.
        plain = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        plain.encode_special_tokens = True
        self._plain = Tokenizer(plain)

    def require(self, param: str | None = None) -> None:
        if self.missing:
            raise InvalidArgument(param, "this model cannot fill in the middle: its vocabulary "
                                         f"has no special token {', '.join(self.missing)} "
                                         "(Qwen2.5-Coder's FIM tokens)")

    def with_end_ids(self, params: SamplingParams) -> SamplingParams:
        """`params` also ending at the FIM end-of-generation tokens."""
        ids = tuple(dict.fromkeys(params.stop_token_ids + self.end_ids))
        return dataclasses.replace(params, stop_token_ids=ids)

    def text_ids(self, text: str) -> list[int]:
        return self._plain.encode(text, add_bos=False) if text else []

    def render(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
               prompt: str = "", *, max_len: int, n_predict: int = 0,
               param: str | None = None) -> Rendered:
        """The prompt ids for a gap between `prefix` and `suffix`, with `extra` (filename,
        text) chunks before it, fitted to `max_len` leaving `n_predict` tokens (at least one)
        to generate. Raises InvalidArgument (naming `param`) for a model without FIM tokens,
        or for a `prompt` that alone leaves no room."""
        self.require(param)
        ids, sep = self.ids, self.ids["file_sep"]
        before, after = self.text_ids(prefix), self.text_ids(suffix)
        middle = self.tokenizer.encode(prompt, add_bos=False) if prompt else []
        context = [ids["repo"], *self.text_ids(PROJECT)] if ids["repo"] is not None else []
        for filename, text in extra:
            context += ([sep, *self.text_ids(filename + "\n")] if sep is not None
                        else self.text_ids(SNIPPET))
            context += self.text_ids(text)
        if sep is not None:
            context += [sep, *self.text_ids(CURRENT_FILE)]
        tok = self.tokenizer
        bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
        fixed = 3 + len(bos) + len(middle)
        room = max_len - max(n_predict, 1)
        if fixed > room:
            raise InvalidArgument(param, f"the prompt has {len(middle)} tokens; with the FIM "
                                         f"tokens and {max(n_predict, 1)} to generate that "
                                         f"exceeds the context of {max_len} (max_model_len)")
        n_pre, n_suf, n_ctx = fim_budget(len(before), len(after), len(context), fixed,
                                         len(middle), max_len, max(n_predict, 0))
        out = (context[len(context) - n_ctx:] + bos + [ids["prefix"]]
               + before[len(before) - n_pre:] + middle + [ids["suffix"]] + after[:n_suf]
               + [ids["middle"]])
        return Rendered(out, (n_pre, n_suf, n_ctx) != (len(before), len(after), len(context)))


def fim_budget(n_prefix: int, n_suffix: int, n_extra: int, n_fixed: int, n_prompt: int,
               max_len: int, n_predict: int) -> tuple[int, int, int]:
    """How many prefix, suffix and extra tokens are kept (the module's rule); `n_fixed`
    counts the tokens never cut (FIM tokens, BOS, prompt), which the caller has checked fit."""
    n_batch = min(N_BATCH, max_len // 4)
    # Cuts that do not depend on n_predict, the output's room (n_batch) set aside: an
    # editor's warm-up (n_predict 0) and its next request render the same tokens, and share
    # their cached blocks.
    take = [min(n_prefix, 3 * (n_batch // 4)),
            min(n_suffix, max(0, n_batch // 4 - (2 + n_prompt))),
            min(n_extra, max_len - 2 * n_batch)]
    # llama.cpp's shares count two of the three FIM tokens and no BOS, and a long prompt or
    # output may not fit beside them: what is over comes off the suffix's end first (the
    # cached extra context and prefix before it stay), then the prefix's start, then the
    # extra context's.
    over = sum(take) + n_fixed - (max_len - max(n_predict, 1))
    for i in (1, 0, 2):
        cut = min(max(over, 0), take[i])
        take[i] -= cut
        over -= cut
    return take[0], take[1], take[2]
