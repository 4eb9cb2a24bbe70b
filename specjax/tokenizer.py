"""Text <-> token ids, backed by a `tokenizers` tokenizer built from a Hugging Face folder's
`tokenizer.json` or from a GGUF file's metadata, plus what a chat model needs beside it:
whether a prompt starts with BOS, every id that ends a turn, and the chat template."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

# Tokens that end a turn in the chat formats in use (llama.cpp keeps the same list): counted
# as end-of-turn ids when the vocabulary has them as special tokens and the chat template
# writes them.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|END_OF_TURN_TOKEN|>", "</s>", "<|end_of_text|>")


class Tokenizer:
    """A `tokenizers.Tokenizer` and the model's special ids.

    `add_bos_token`: whether a text prompt starts with `bos_token_id` (as the tokenizer's
    own configuration says; a chat template writes its own). `eos_token_ids`: every id that
    ends generation (end of text and end of turn). `chat_template`: the Jinja source, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), add_bos_token: bool | None = None,
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = (bos_token_id is not None if add_bos_token is None
                              else add_bos_token and bos_token_id is not None)
        self.chat_template = chat_template
        self.eos_token_ids = tuple(dict.fromkeys(
            list(eos_token_ids) + list(self._template_end_ids(chat_template))))

    def _template_end_ids(self, template: str | None) -> list[int]:
        if not template:
            return []
        ids = []
        for text in END_OF_TURN_TEXTS:
            token = self.backend.token_to_id(text)
            # A ChatML model's text also ends at <|endoftext|>, which its template never
            # writes (Qwen2.5's generation_config stops at both; llama.cpp counts both).
            written = text in template or (text == "<|endoftext|>" and "<|im_end|>" in template)
            if token is not None and written and _is_special(self.backend, text):
                ids.append(token)
        return ids

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    @classmethod
    def from_model(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer of a resolved model path: a GGUF file's, a folder's `tokenizer.json`
        (None when the folder has none)."""
        path = Path(path)
        if path.is_file():
            return cls.from_gguf(path)
        return cls.from_folder(path) if (path / "tokenizer.json").exists() else None

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """`tokenizer.json` plus the special ids of `config.json`, `generation_config.json`
        and `tokenizer_config.json`; the chat template from `tokenizer_config.json` or
        `chat_template.jinja` (where transformers 5 writes it)."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} is missing")
        backend = tokenizers.Tokenizer.from_file(str(file))
        config = _json(folder / "config.json")
        tok_config = _json(folder / "tokenizer_config.json")
        eos = _ids(config.get("eos_token_id")) + _ids(
            _json(folder / "generation_config.json").get("eos_token_id"))
        eos_text = _token_text(tok_config.get("eos_token"))
        if eos_text and backend.token_to_id(eos_text) is not None:
            eos.append(backend.token_to_id(eos_text))
        bos = config.get("bos_token_id")
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # several named templates: take "default"
            template = {t.get("name"): t.get("template") for t in template
                        if isinstance(t, dict)}.get("default")
        jinja = folder / "chat_template.jinja"
        if not isinstance(template, str) and jinja.exists():
            template = jinja.read_text()
        return cls(backend, bos, eos, _folder_adds_bos(backend, bos, tok_config),
                   template if isinstance(template, str) else None)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer a GGUF file's metadata describes: byte-level BPE ("gpt2": its
        pre-tokenizer from `tokenizer.ggml.pre`) or SentencePiece BPE ("llama"), special and
        user-defined tokens, BOS as `add_bos_token` says (llama.cpp's defaults where the file
        is silent), end-of-text/turn ids and the chat template."""
        from specjax.models.gguf_checkpoint import read_gguf_metadata
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _GGUF_BUILDERS:
            raise ValueError(f"GGUF tokenizer {kind!r} in {path} is not supported (supported: "
                             f"{', '.join(_GGUF_BUILDERS)})")
        backend = _GGUF_BUILDERS[kind](meta)
        g = lambda key: meta.get(f"tokenizer.ggml.{key}")
        eos = [i for i in (g("eos_token_id"), g("eot_token_id"), g("eom_token_id"))
               if i is not None]
        add_bos = g("add_bos_token")
        if add_bos is None:  # llama.cpp: SentencePiece vocabularies start with BOS
            add_bos = kind == "llama"
        return cls(backend, g("bos_token_id"), eos, bool(add_bos),
                   meta.get("tokenizer.chat_template"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = False) -> list[int]:
        """`add_bos`: None follows the tokenizer (`add_bos_token`: what `LLM` and the
        server do with a text prompt)."""
        # The batch entry points release the GIL while they work (plain `encode` holds it: a
        # 1 MiB prompt would stall every other thread, a server's event loop among them);
        # `encode_batch_fast` also skips the offsets nobody reads here.
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        ids = batch([text], add_special_tokens=False)[0].ids
        add_bos = self.add_bos_token if add_bos is None else add_bos
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _ids(value: Any) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _token_text(value: Any) -> str:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _is_special(backend: tokenizers.Tokenizer, text: str) -> bool:
    return any(t.content == text and t.special
               for t in backend.get_added_tokens_decoder().values())


def _folder_adds_bos(backend: tokenizers.Tokenizer, bos: int | None,
                     tok_config: dict) -> bool:
    """Whether a folder's text prompts start with BOS: `add_bos_token` where
    tokenizer_config.json says; a null `bos_token` there means none; else whether the
    tokenizer's post-processor inserts it; a folder saying nothing at all (specjax's own
    checkpoints, trained with BOS before every document) gets it."""
    if bos is None:
        return False
    if "add_bos_token" in tok_config:
        return bool(tok_config["add_bos_token"])
    if "bos_token" in tok_config and tok_config["bos_token"] is None:
        return False
    if backend.post_processor is not None:
        return backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return not tok_config


# ---- GGUF metadata -> tokenizers ------------------------------------------------------------

# llama.cpp's token types (`tokenizer.ggml.token_type`) that are added tokens.
_TOKEN_TYPES = {"control": 3, "user_defined": 4}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's (Nemo, Small 3): a word is its capitals then its small letters (camelCase: camel,
# Case), a digit stands alone.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary cuts text into words before its merges, as the
    model's tokenizer.json (and llama.cpp, by `tokenizer.ggml.pre`) does."""

    split: str | None = None  # the words are this regex's matches (None: GPT-2's regex)
    digits: bool = False  # every digit a word of its own before GPT-2's regex (SmolLM)
    whole_words: bool = False  # a word in the vocabulary is one token, merged or not

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        if self.split is not None:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(self.split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.digits:
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
        return gpt2


# `tokenizer.ggml.pre` -> its pre-tokenizer, grouped as llama.cpp's pre-tokenizer types
# group them (whole words: its ignore_merges). A name not listed splits as GPT-2, with a
# warning. (llama.cpp splits a "default" file's punctuation runs and digit triples apart
# too; transformers' GGUF tokenizer, like this one, splits it as GPT-2.)
PRE_TOKENIZERS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"),
                    PreTokenizer(_LLAMA3_SPLIT, whole_words=True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), PreTokenizer(_QWEN2_SPLIT)),
    "tekken": PreTokenizer(_TEKKEN_SPLIT, whole_words=True),
    "smollm": PreTokenizer(digits=True),
    **dict.fromkeys(("gpt2", "gpt-2", "default"), PreTokenizer()),
}


def _byte_level(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    tokens, name = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 "
                    "does", name)
        pre = PRE_TOKENIZERS["gpt2"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                          ignore_merges=pre.whole_words))
    tok.pre_tokenizer = pre.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, meta)
    return tok


def _sentencepiece(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:  # SentencePiece files rank merges by the merged piece's score
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        ranked = sorted(((-scores[vocab[t]], vocab[t[:i]], vocab[t[i:]], t[:i], t[i:])
                         for t in tokens for i in range(1, len(t))
                         if t[:i] in vocab and t[i:] in vocab))
        merges = [(left, right) for *_, left, right in ranked]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True,
                                          unk_token=None if unk is None else tokens[unk]))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("\u2581")] if prefix else [])
        + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_special(tok, meta)
    return tok


def _add_special(tok: tokenizers.Tokenizer, meta: dict[str, Any]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens:
    both are matched whole in text, as llama.cpp does."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _TOKEN_TYPES["control"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _TOKEN_TYPES["user_defined"]])


_GGUF_BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}
