"""The bench's held-out prompts stay out of the self-distillation data."""
from specjax.analysis.heldout import CHAT, CODE, EDIT, overlaps_heldout
from specjax.train.prompts import (HUMAN_LANGUAGES, LANGUAGES, make_prompts,
                                   question_from_answer)


def test_every_heldout_prompt_and_any_text_quoting_six_of_its_words_is_caught():
    for prompt in CHAT + CODE + EDIT:
        assert overlaps_heldout(prompt)
        words = prompt.split()
        if len(words) >= 7:
            assert overlaps_heldout("Please help: " + " ".join(words[1:7]) + " thanks")
    assert not overlaps_heldout("Explain what `json.dumps` does in Python.")
    # Five words of a held-out prompt are not a run of six.
    assert not overlaps_heldout("Write a Python function that parses dates")


def test_made_prompts_are_deterministic_cover_every_source_and_avoid_the_bench():
    a, b = make_prompts(0), make_prompts(0)
    assert a == b and a != make_prompts(1)
    assert {s for s, _ in a} == {"stdlib", "topics", "code", "edits"}
    # Edits quote what they rewrite: standard-library functions and docstring paragraphs,
    # some to be translated.
    edits = [t for s, t in a if s == "edits"]
    assert sum("```python\ndef " in t for t in edits) > 100
    assert any(f"into {lang}:" in t for t in edits for lang in HUMAN_LANGUAGES)
    code = [t for s, t in a if s == "code"]
    assert any("SQL" in t for t in code) and any("bash" in t for t in code)
    assert len({lang for lang in LANGUAGES if any(f" {lang} " in t for t in code)}) == \
        len(LANGUAGES)
    assert sum(s == "stdlib" for s, _ in a) > 200
    assert len({t for _, t in a}) == len(a)
    assert not any(overlaps_heldout(t) for _, t in a)


def test_self_instruct_keeps_a_question_line_only():
    assert question_from_answer('"How do bees make honey?"\nThey...') == "How do bees make honey?"
    assert question_from_answer("Bees are insects.") is None
    assert question_from_answer("?") is None
    # Requests and tasks (the other self-instruct forms) have no question mark.
    assert question_from_answer("Write a Go program that prints a calendar.\n") == \
        "Write a Go program that prints a calendar."
    assert question_from_answer("I lost my keys twice this week and feel stressed.") == \
        "I lost my keys twice this week and feel stressed."
