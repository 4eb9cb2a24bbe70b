"""GGUF byte-level tokenizers (`tokenizer.PRE_TOKENIZERS`, by `tokenizer.ggml.pre`) against the
`tokenizers` library set up as each model's own tokenizer.json sets it up, on awkward text:
the pre-tokenization alone, then whole encodes over a small BPE vocabulary trained here (one
of its tokens reachable by no merge, so a pre-tokenizer's whole-word lookup shows)."""
import json

import pytest
import tokenizers
from tokenizers import Regex, models, pre_tokenizers, trainers

from specjax.models.gguf_checkpoint import write_gguf
from specjax.tokenizer import PRE_TOKENIZERS, Tokenizer

# The Split regexes as the models' tokenizer.json files have them (Qwen2.5, Llama 3, Mistral
# Nemo's tekken), written out here rather than imported so that a slip in ours shows.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])


# name -> (the tokenizer.json pre_tokenizer, its BPE model's ignore_merges)
REFERENCES = {
    "qwen2": (lambda: split_then_bytes(QWEN2), False),
    "llama-bpe": (lambda: split_then_bytes(LLAMA3), True),
    "tekken": (lambda: split_then_bytes(TEKKEN), True),
    "smollm": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]),
        False),
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                              use_regex=True), False),
}
TEXTS = [
    "naïve café, Ελληνικά, русский текст, e\u0301 (a combining accent)",
    "7 42 123 2024 12345 3.14159 1,000,000 v2.0.1 0x1F",
    "it's don't you're I've I'm we'll he'd IT'S DON'T You'Re 'quoted'",
    "中文字符和标点。日本語のテキスト、カタカナ。한국어 문장!",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 ★☆",
    "a  b\t\tc\n\nd \n e\r\n f   \n\n\n   g\u00a0h\u3000i  ",
    "def f(x):\n    if x:\n\treturn x**2  # square\n\n\nclass A:\n        pass\n",
    "camelCase HTTPServer getURLPath XMLHttpRequest snake_case_name",
    "  leading spaces and a trailing one ",
    "zyzzyva zyzzyvas",
]
WHOLE_WORD = "Ġzyzzyva"  # in the vocabulary, but no merge makes it
ENDOFTEXT = "<|endoftext|>"


@pytest.mark.parametrize("name", REFERENCES)
def test_pre_tokenization_is_the_tokenizer_json_one(name):
    ours = PRE_TOKENIZERS[name].pre_tokenizer()
    reference = REFERENCES[name][0]()
    for text in TEXTS:
        assert ours.pre_tokenize_str(text) == reference.pre_tokenize_str(text), text


def trained_vocabulary(reference) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE of 500 tokens learned from TEXTS split as `reference` splits them,
    plus WHOLE_WORD."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = reference
    tok.train_from_iterator([t for t in TEXTS if "zyzzyva" not in t] * 4, trainers.BpeTrainer(
        vocab_size=500, show_progress=False, special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())["model"]
    vocab = dict(spec["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    vocab[WHOLE_WORD] = len(vocab)
    return vocab, merges


@pytest.mark.parametrize("name", REFERENCES)
def test_gguf_tokenizer_encodes_as_the_tokenizer_json_one(name, tmp_path):
    """The same vocabulary as a GGUF's tokenizer keys, read by `Tokenizer.from_gguf`, encodes
    every text as the tokenizer.json-style tokenizer does, and decodes it back."""
    make, whole_words = REFERENCES[name]
    vocab, merges = trained_vocabulary(make())
    reference = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=whole_words))
    reference.pre_tokenizer = make()
    reference.add_special_tokens([ENDOFTEXT])
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    path = write_gguf(tmp_path / "tokenizer.gguf", {
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": name, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) for m in merges],
        "tokenizer.ggml.token_type": [3 if t == ENDOFTEXT else 1 for t in tokens]}, {})
    ours = Tokenizer.from_gguf(path)
    for text in TEXTS + [f"one{ENDOFTEXT}two"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # the unmergeable word is one token exactly where the pre-tokenizer looks words up whole
    assert (vocab[WHOLE_WORD] in ours.encode("a zyzzyva")) == whole_words


def test_unknown_pre_tokenizer_splits_as_gpt2_and_says_so(tmp_path, caplog):
    vocab, merges = trained_vocabulary(REFERENCES["gpt2"][0]())
    tokens = sorted(vocab, key=vocab.get)
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [" ".join(m) for m in merges]}
    gpt2 = Tokenizer.from_gguf(write_gguf(tmp_path / "gpt2.gguf", {
        **meta, "tokenizer.ggml.pre": "gpt2"}, {}))
    with caplog.at_level("WARNING"):
        unknown = Tokenizer.from_gguf(write_gguf(tmp_path / "unknown.gguf", {
            **meta, "tokenizer.ggml.pre": "no-such-split"}, {}))
    assert "'no-such-split' is not known here" in caplog.text
    assert [unknown.encode(t) for t in TEXTS] == [gpt2.encode(t) for t in TEXTS]
