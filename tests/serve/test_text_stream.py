"""Streamed text deltas add up to the final text: split characters and stop-string starts are
held back, never sent and then taken back."""
from __future__ import annotations

import pytest

from specjax.serve.text_stream import REPLACEMENT, TextStream, stop_prefix_len


class PieceTokenizer:
    """Token id i decodes to PIECES[i]; enough to script stop-string cases exactly."""

    PIECES = ["a", "b", "\n", "x", "END"]

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize("text, stops, expected", [
    ("abc\n", ["\n\n"], 1),
    ("abc", ["\n\n"], 0),
    ("abcE", ["END", "Ex"], 1),
    ("abEN", ["END"], 2),
    ("abEN", ["N", "ENDX"], 2),
    ("", ["END"], 0),
    ("abc", [], 0),
])
def test_stop_prefix_len(text, stops, expected):
    assert stop_prefix_len(text, stops) == expected


def test_stop_string_start_is_held_until_it_resolves():
    stream = TextStream(PieceTokenizer(), stops=["\n\n"])
    assert stream.delta([0, 1], False) == "ab"
    assert stream.delta([0, 1, 2], False) == ""          # might start "\n\n"
    assert stream.delta([0, 1, 2, 3], False) == "\nx"    # it did not
    assert stream.delta([0, 1, 2, 3, 2], False) == ""
    # The engine found the stop string and cut the final text before it.
    assert stream.delta([0, 1, 2, 3, 2, 2], True, final_text="ab\nx") == ""
    assert stream.sent == "ab\nx"


def test_finished_output_flushes_what_was_held():
    stream = TextStream(PieceTokenizer(), stops=["ENDX"])
    assert stream.delta([0, 4], False) == "a"
    assert stream.delta([0, 4], True, final_text="aEND") == "END"


def test_split_multibyte_characters_never_reach_the_client(bundled_tokenizer):
    text = "naïve → 中文 ok ✓ done"
    ids = bundled_tokenizer.encode(text)
    partial = [bundled_tokenizer.decode(ids[:k]) for k in range(1, len(ids))]
    assert any(p.endswith(REPLACEMENT) for p in partial)  # the case under test occurs
    stream = TextStream(bundled_tokenizer)
    deltas = [stream.delta(ids[:k], False) for k in range(1, len(ids))]
    deltas.append(stream.delta(ids, True, final_text=bundled_tokenizer.decode(ids)))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text


def _stream_in_chunks(stream: TextStream, ids: list[int], final_text: str,
                      sizes=(1, 3, 2, 5, 1, 4)) -> list[str]:
    """Cumulative outputs growing by a few tokens per event, as the engine delivers them."""
    deltas, k, i = [], 0, 0
    while k < len(ids):
        k = min(len(ids), k + sizes[i % len(sizes)])
        i += 1
        deltas.append(stream.delta(ids[:k], False))
    deltas.append(stream.delta(ids, True, final_text=final_text))
    return deltas


def test_long_multibyte_output_adds_up_exactly(bundled_tokenizer):
    text = "".join(f"{i}: naïve → 中文, ✓ ünïcödé 🙂\n" for i in range(300))
    ids = bundled_tokenizer.encode(text)
    assert len(ids) > 3000
    stream = TextStream(bundled_tokenizer, stops=["\n\n", "🙂🙂"])
    deltas = _stream_in_chunks(stream, ids, bundled_tokenizer.decode(ids))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text == stream.sent
    assert sum(1 for d in deltas if d) > 1000   # it streamed, rather than all at the end


def test_each_id_is_decoded_once(bundled_tokenizer, monkeypatch):
    import specjax.serve.text_stream as text_stream

    fed: list[int] = []
    real = text_stream.DecodeStream

    class CountingDecodeStream:
        def __init__(self, **kwargs):
            self.inner = real(**kwargs)

        def step(self, tokenizer, token_id):
            fed.append(token_id)
            return self.inner.step(tokenizer, token_id)

    def no_full_decode(*args, **kwargs):
        raise AssertionError("the whole output was decoded again")

    monkeypatch.setattr(text_stream, "DecodeStream", CountingDecodeStream)
    monkeypatch.setattr(bundled_tokenizer, "decode", no_full_decode)
    text = "def f(x):\n    return x * 2  # ✓ 中文\n" * 50
    ids = bundled_tokenizer.encode(text)
    deltas = _stream_in_chunks(TextStream(bundled_tokenizer), ids, final_text=text)
    assert fed == ids                        # every id once, in order: linear work
    assert "".join(deltas) == text


def test_piece_tokenizer_is_fed_only_new_ids():
    calls: list[list[int]] = []

    class Counting(PieceTokenizer):
        def decode(self, ids):
            calls.append(list(ids))
            return super().decode(ids)

    stream = TextStream(Counting())
    ids = [0, 1, 3] * 100
    deltas = [stream.delta(ids[:k], False) for k in range(1, len(ids) + 1)]
    assert "".join(deltas) == "abx" * 100
    assert sum(map(len, calls)) == len(ids)
