"""The command lines a newcomer types: generate and the benchmarks' argument handling."""
import subprocess
import sys

import pytest

from specjax import generate
from specjax.bench.__main__ import main as bench_main


def test_generate_bundled_prints_the_continuation(capsys):
    assert generate.main(["--prompt", "def fibonacci(n):", "--max-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):") and len(out) > len("def fibonacci(n):\n")
    assert "tokens/s" in err


def test_generate_reports_acceptance_when_speculating(capsys):
    assert generate.main(["--prompt", "import os\nimport os\nimport", "--max-tokens", "24",
                          "--speculative-config", "ngram"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("[NGRAM:"))
    al = float(line.split("acceptance length ")[1].split()[0])
    assert al >= 1.0 and "acceptance rate" in line and "by position k" in line


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "-3"], "max_tokens must be >= 1"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--model", "/nonexistent/folder"], "neither a known name nor an existing local folder"),
])
def test_generate_rejects_bad_arguments_before_loading(capsys, args, message):
    assert generate.main(args) == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_unknown_subcommand():
    with pytest.raises(SystemExit):
        bench_main(["nope"])


def test_module_entry_points_have_help():
    for module in ("specjax.generate", "specjax.bench", "specjax.train", "specjax.serve",
                   "specjax.serve.loadtest", "specjax.serve.soak"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and "usage" in result.stdout.lower(), module


@pytest.mark.slow
def test_bench_decode_prints_a_row_per_batch_size(capsys):
    bench_main(["decode", "--model", "bundled", "--no-hf", "--batch-sizes", "1", "2",
                "--max-tokens", "8", "--repeats", "1", "--verify-len", "2"])
    out = capsys.readouterr().out
    table, verify = out.split("verification cost")
    rows = [line.split() for line in table.splitlines()]
    rows = [r for r in rows if r and r[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 for r in rows)
    assert "roofline (batch 1)" in table and "x the floor" in table
    ratios = [line.split() for line in verify.splitlines() if line.split()[:1] == ["1"]]
    assert len(ratios) == 1 and len(ratios[0]) == 4 and all(float(x) > 0 for x in ratios[0][1:])


@pytest.mark.parametrize("module, argv", [("specjax.serve.loadtest", ["--clients", "1"]),
                                          ("specjax.serve.soak", ["--url", "http://x"])])
def test_load_clients_name_their_extra_when_httpx_is_missing(monkeypatch, module, argv):
    import importlib
    import importlib.util
    main = importlib.import_module(module).main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "httpx" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert 'pip install -e ".[loadtest]"' in str(exc.value) and "httpx" in str(exc.value)
