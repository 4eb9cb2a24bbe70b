"""scripts/gpu_check.py is what the next session with a GPU runs first, in a window of
minutes: its GPU-only sections must run on the CPU at tiny shapes (--tiny) before they ever
meet a GPU, and a bad section name is refused before anything starts."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_gpu_it_checks_nothing_and_says_so():
    proc = _run()
    assert proc.returncode == 0 and proc.stdout.startswith("no GPU"), proc.stdout + proc.stderr


def test_an_unknown_section_is_refused():
    proc = _run("--tiny", "--sections", "checks,attn")
    assert proc.returncode == 2 and "unknown sections ['attn']" in proc.stderr


@pytest.mark.slow
def test_tiny_dry_run_of_the_attention_and_8b_sections():
    proc = _run("--tiny", "--sections", "attention,8b")
    out = proc.stdout
    assert proc.returncode == 0 and "all sections passed" in out, out[-4000:] + proc.stderr[-4000:]
    # 2 contexts x 2 batch sizes x (T = 1, 5, tree) + a short context in a wide table x 2
    assert len(re.findall(r"^  ctx=\d+ .* (\d+\.\d|nan)$", out, re.M)) == 14, out
    for section in ("-- decode:", "-- verify:", "-- spec:"):
        assert section in out
    spec_rows = re.findall(r"^ ([24]) +2 +([\d.]+) .* (yes|NO)$", out, re.M)
    assert [r[0] for r in spec_rows] == ["2", "4"] and all(r[2] == "yes" for r in spec_rows)
    assert all(float(r[1]) > 2.5 for r in spec_rows), spec_rows  # the oracle's AL (3 at most)
