"""The bench's held-out prompts stay out of the self-distillation data."""
from specjax.analysis.heldout import CHAT, CODE, overlaps_heldout
from specjax.train.prompts import make_prompts, question_from_answer


def test_every_heldout_prompt_and_any_text_quoting_six_of_its_words_is_caught():
    for prompt in CHAT + CODE:
        assert overlaps_heldout(prompt)
        words = prompt.split()
        if len(words) >= 7:
            assert overlaps_heldout("Please help: " + " ".join(words[1:7]) + " thanks")
    assert not overlaps_heldout("Explain what `json.dumps` does in Python.")
    # Five words of a held-out prompt are not a run of six.
    assert not overlaps_heldout("Write a Python function that parses dates")


def test_made_prompts_are_deterministic_cover_both_sources_and_avoid_the_bench():
    a, b = make_prompts(0), make_prompts(0)
    assert a == b and a != make_prompts(1)
    assert {s for s, _ in a} == {"stdlib", "topics"}
    assert sum(s == "stdlib" for s, _ in a) > 200
    assert len({t for _, t in a}) == len(a)
    assert not any(overlaps_heldout(t) for _, t in a)


def test_self_instruct_keeps_a_question_line_only():
    assert question_from_answer('"How do bees make honey?"\nThey...') == "How do bees make honey?"
    assert question_from_answer("Bees are insects.") is None
    assert question_from_answer("?") is None
