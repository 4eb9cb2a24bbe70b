"""Structured output on the host (`specjax.engine.grammar`): the masks the steps get along a
request's drafts and trees, against llguidance's own matcher advanced token by token; what a
bad constraint is told; choices and the end of a grammar."""
import json

import llguidance
import numpy as np
import pytest

from specjax import SamplingParams
from specjax.engine.grammar import Grammars, mask_width
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument

V = 4096
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
TEXT = '{"name": "ab", "n": 42}'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(CHECKPOINTS_DIR / BUNDLED_TARGET)


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, V, [0])


def allowed(grammar) -> np.ndarray:
    """The matcher's own mask now, unpacked to [V] bools."""
    out = np.zeros((1, mask_width(V)), np.int32)
    grammar.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return unpack(out[0])


def unpack(words: np.ndarray) -> np.ndarray:
    return ((words[:, None] >> np.arange(32)) & 1).reshape(-1)[:V] == 1


def test_chain_masks_follow_the_drafts_and_stop_at_the_first_forbidden(grammars, tok):
    ids = tok.encode(TEXT)
    # The 5th draft breaks the grammar: "x" where a digit must come ('"n": 4').
    k = ids.index(tok.encode(" 42")[0])
    assert k >= 6, [tok.decode([t]) for t in ids]
    g = grammars.matcher(SamplingParams(guided_json=SCHEMA))
    for t in ids[:k - 4]:  # some output committed already
        assert g.advance(t)
    drafts = ids[k - 4:k] + [tok.encode("x")[0]] + ids[k + 1:k + 3]
    R = len(drafts) + 1
    masks = np.full((3, R, mask_width(V)), -1, np.int32)
    grammars.fill(masks, [(1, g, drafts)])
    assert (masks[0] == -1).all() and (masks[2] == -1).all()    # other rows untouched
    ref = grammars.matcher(SamplingParams(guided_json=SCHEMA))
    for t in ids[:k - 4]:
        ref.advance(t)
    for j in range(5):   # masks after 0..4 drafts; draft 5 is forbidden by the last of them
        np.testing.assert_array_equal(unpack(masks[1, j]), allowed(ref))
        assert allowed(ref)[drafts[j]] == (j < 4)
        if j < 4:
            assert ref.advance(drafts[j])
    assert (masks[1, 5:] == -1).all()       # past the forbidden draft: all ones
    # Computing the masks left the request's matcher where its output ends.
    assert all(g.advance(t) for t in ids[k - 4:]) and g.done


def test_tree_masks_follow_each_nodes_path(grammars, tok):
    ids = tok.encode(TEXT)
    bad = tok.encode("x")[0]
    # root -> a=ids[0] -> b=ids[1] -> c=ids[2]; root -> bad -> child of bad; a -> bad
    tokens = [ids[0], bad, ids[1], ids[2], ids[3], bad]
    parents = [0, 0, 1, 3, 2, 1]
    g = grammars.matcher(SamplingParams(guided_json=SCHEMA))
    masks = np.full((1, len(tokens) + 1, mask_width(V)), -1, np.int32)
    grammars.fill_tree(masks, 0, g, tokens, parents)
    paths = {1: ids[:1], 3: ids[:2], 4: ids[:3]}
    ref = grammars.matcher(SamplingParams(guided_json=SCHEMA))
    np.testing.assert_array_equal(unpack(masks[0, 0]), allowed(ref))
    for row, path in paths.items():
        ref = grammars.matcher(SamplingParams(guided_json=SCHEMA))
        assert all(ref.advance(t) for t in path)
        np.testing.assert_array_equal(unpack(masks[0, row]), allowed(ref))
    for row in (2, 5, 6):   # a forbidden node, its child, and the forbidden child of row 1
        assert (masks[0, row] == -1).all()
    assert all(g.advance(t) for t in ids) and g.done   # the matcher is where it began


@pytest.mark.parametrize("kwargs, field, words", [
    ({"guided_regex": "("}, "guided_regex", "unclosed group"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "strin"),
    ({"guided_json": '{"type": "object"'}, "guided_json", "guided_json"),
    ({"guided_grammar": "start: foo("}, "guided_grammar", "guided_grammar"),
])
def test_bad_constraints_are_named(grammars, kwargs, field, words):
    params = SamplingParams(**kwargs)
    with pytest.raises(InvalidArgument, match=words) as e:
        grammars.check(params)
    assert e.value.param == field


@pytest.mark.parametrize("kwargs, field", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
])
def test_bad_fields_are_refused_at_construction(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_a_schema_keeps_its_key_order_and_the_params_stay_hashable():
    params = SamplingParams(guided_json={"b": 1, "a": 2})
    assert params.guided_json == '{"b": 1, "a": 2}' and params.guided == "guided_json"
    assert hash(params) == hash(SamplingParams(guided_json={"b": 1, "a": 2}))
    assert SamplingParams().guided is None and SamplingParams(guided_json=False).guided is None


def test_choices_take_any_text_and_end_the_grammar(grammars, tok):
    choices = ["yes", 'say "hi" \\ back', "naïve\n", "a|b(c)*"]
    for c in choices:
        g = grammars.matcher(SamplingParams(guided_choice=choices))
        ids = tok.encode(c)
        assert all(g.advance(t) for t in ids), c
        assert g.done
    g = grammars.matcher(SamplingParams(guided_choice=choices))
    assert not g.advance(tok.encode("no")[0])


def test_json_is_compact_and_whitespace_is_not_free(grammars, tok):
    g = grammars.matcher(SamplingParams(guided_json=True))
    assert all(g.advance(t) for t in tok.encode('{"a": [1, 2], "b": {"c": null}}')) and g.done
    g = grammars.matcher(SamplingParams(guided_json=True))
    assert all(g.advance(t) for t in tok.encode('{"a":'))
    assert not allowed(g)[tok.encode("\n")[0]]


def test_the_matchers_tokenizer_is_the_models(grammars, tok):
    # Every token's bytes agree: llguidance reads the same tokenizer.json.
    ll = grammars.tokenizer
    for text in ["def f(x):\n    return x", json.dumps(SCHEMA), "naïve ünïcode"]:
        ids = tok.encode(text)
        assert ll.decode_str(ids) == tok.decode(ids)
    assert isinstance(ll, llguidance.LLTokenizer) and ll.vocab_size == V


def test_forced_tokens_spell_what_the_grammar_admits_one_way_only(grammars, tok):
    g = grammars.matcher(SamplingParams(guided_json=SCHEMA))
    assert g.advance(tok.encode("{")[0])
    forced = g.forced(16)
    # The first key is fixed (what follows may be tokenised several ways: left to the model).
    assert tok.decode(forced) == '"name":' and len(forced) >= 2
    assert g.forced(2) == forced[:2] and g.forced(0) == []
    assert all(g.advance(t) for t in forced)      # and the grammar takes them
    g = grammars.matcher(SamplingParams(guided_choice=["yes", "no"]))
    assert g.forced(4) == []                       # a real choice: nothing forced
