"""examples/custom_loop.py drives the public step API (`specjax.core`) by hand: its tokens must
match `LLM.generate`, and its drafters must really be drafting (AL > 1), or the example would
prove nothing about speculation."""
import importlib.util
from pathlib import Path

import pytest

from specjax.models.registry import CHECKPOINTS_DIR

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_loop.py"
pytestmark = pytest.mark.skipif(
    not (CHECKPOINTS_DIR / "stdlib-eagle3" / "config.json").exists(),
    reason="no bundled checkpoints")


def load_example():
    spec = importlib.util.spec_from_file_location("custom_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow   # two engines and the hand-driven steps of each compiled: ~21 s here
def test_custom_loop_matches_llm_generate_and_accepts_drafts(capsys):
    # Two prompts (one longer than a prefill chunk) in one batch; 24 tokens keeps several
    # generation steps while compiling (which dominates on CPU) stays the same.
    results = load_example().main(max_tokens=24)
    printed = capsys.readouterr().out
    assert set(results) == {"ngram", "eagle3"}
    for name, r in results.items():
        assert r["match"], f"{name}: the hand-driven loop differs from LLM.generate"
        assert r["al"] > 1.0, f"{name}: no draft was accepted (AL {r['al']:.2f})"
        assert [len(o) for o in r["outputs"]] == [24, 24]
    # Greedy speculation is exact: both modes give the plain greedy tokens.
    assert results["ngram"]["outputs"] == results["eagle3"]["outputs"]
    assert printed.count("matches LLM.generate: True") == 2
