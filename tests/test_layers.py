"""The import contracts in pyproject.toml hold for the tree, and catch an upward import.

`lint-imports` (import-linter) checks the layers of ARCHITECTURE.md: programs -> llm -> engine
-> speculative -> core -> models -> pallas_kernels. Planting an upward import in a copy of the
tree must break them, or the contracts prove nothing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter")
    # The copy's packages come first on the path, ahead of the installed (editable) ones.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = ("import sys; sys.path.insert(0, %r); from importlinter.cli import lint_imports_command;"
            " lint_imports_command()" % str(tree))
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in ("specjax", "pallas_kernels"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


@pytest.mark.parametrize("module, planted, broken", [
    (None, None, None),
    ("specjax/core/steps.py", "from specjax.engine import scheduler", "layers"),
    ("specjax/models/llama.py", "import specjax.core.kv", "layers"),
    ("specjax/speculative/build.py", "from specjax.llm import LLM", "layers"),
    ("specjax/serve/app.py", "import specjax.bench.spec", "layers"),
    ("pallas_kernels/backend.py", "import specjax.models", "kernels import nothing"),
])
def test_contracts(tree_copy, module, planted, broken):
    if module is not None:
        path = tree_copy / module
        original = path.read_text()
        path.write_text(original + f"\n{planted}  # planted\n")
    try:
        result = _lint(tree_copy)
    finally:
        if module is not None:
            path.write_text(original)
    report = result.stdout + result.stderr
    if broken is None:
        assert result.returncode == 0, report
        assert "0 broken" in report
    else:
        assert result.returncode != 0, report
        assert "BROKEN" in report and broken in report.split("Broken contracts")[-1], report
