import inspect
import textwrap

import pytest

from specjax.train import tokenizer_training as toks

SAMPLES = [
    "",
    "def f(x):\n    return x + 1\n",
    "    leading spaces, trailing spaces   \n\n",
    "\tmixed\t tabs\r\nand CRLF\r\n",
    "naïve café — “quotes” 日本語 🎉 \u200b\x00\x7f",
    "x=1;y =  2  # comment with    runs of spaces",
    " starts with one space",
]


@pytest.fixture(scope="module")
def tok():
    # A small sample of real Python: the tokenizer must still encode bytes it never saw.
    text = inspect.getsource(textwrap)
    return toks.train_tokenizer([text[i : i + 2000] for i in range(0, len(text), 2000)], vocab_size=300)


def test_vocab_and_special_token(tok):
    assert tok.get_vocab_size() <= 300
    assert toks.special_token_id(tok) == 0


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_round_trip_with_special_token(tok):
    text = "<|endoftext|>def g():\n    pass\n"
    ids = tok.encode(text).ids
    assert ids[0] == 0
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_save_and_load(tok, tmp_path):
    toks.save_tokenizer(tok, tmp_path)
    loaded = toks.load_tokenizer(tmp_path)
    for text in SAMPLES:
        assert loaded.encode(text).ids == tok.encode(text).ids
