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
