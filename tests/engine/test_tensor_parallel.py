"""Tensor parallelism on forced CPU devices (a subprocess: the rest of the suite keeps one
device, `tests/engine/tp_run.py`): every mode's greedy, seeded sampled and penalised output at
2 and 4 devices equals one device's token for token, with real acceptance, no compile after
warm-up and every block back; weights and pool are split as the plan says. In the slow job:
one subprocess runs every mode at 1, 2 and 4 devices (about 2 minutes here)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC_MODES = ["ngram", "sa", "draft_target", "eagle3", "mtp", "tree"]  # perm target


def tp_results(modes: list[str], sizes: list[int]) -> dict:
    # The suite's XLA flags (tests/conftest.py) and four host devices.
    env = {**os.environ, "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""),
                                                 "--xla_force_host_platform_device_count=4"])}
    done = subprocess.run([sys.executable, "-m", "tests.engine.tp_run",
                           json.dumps({"modes": ["plain", *modes], "sizes": sizes})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TP_RESULT "))
    return json.loads(line.removeprefix("TP_RESULT "))


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def every_mode():
    return tp_results(SPEC_MODES, [2, 4])


def check_modes(results: dict, modes: list[str], sizes: list[int]) -> None:
    assert results["devices"] == 4
    for mode in ["plain", *modes]:
        one = results[mode]["1"]
        plain = results["bundled_plain" if mode.startswith("bundled") else "plain"]["1"]
        assert one["greedy"] == plain["greedy"], f"{mode} greedy differs from plain decoding"
        for size in map(str, sizes):
            run = results[mode][size]
            for key in ("greedy", "sampled", "penalised"):
                assert run[key] == one[key], f"{mode} at {size} devices: {key} output differs"
            for got, want in zip(run["logprobs"], one["logprobs"]):
                for g, w in zip(got, want):
                    assert [t for t, _ in g] == [t for t, _ in w]
                    assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4
            assert run["compiles_after_warmup"] == 0, f"{mode} at {size} devices compiled"
            assert run["pool_full"], f"{mode} at {size} devices leaked blocks"
            if not mode.endswith("plain"):
                assert 0 < run["accepted"] < run["drafted"], (mode, size, run["accepted"],
                                                              run["drafted"])


def check_placement(results: dict, sizes: list[int]) -> None:
    # Layers are stacked `[L, ...]`: the split axis counts from the end.
    split = {"q_proj": "(None, None, 'tp')", "k_proj": "(None, None, 'tp')",
             "v_proj": "(None, None, 'tp')", "gate_proj": "(None, None, 'tp')",
             "up_proj": "(None, None, 'tp')", "o_proj": "(None, 'tp', None)",
             "down_proj": "(None, 'tp', None)"}
    for size in sizes:
        placement = results["plain"][str(size)]["placement"]
        layer = {**split, "input_norm": "()", "post_norm": "()"}
        unrolled = "layers.0.input_norm" in placement  # the CPU default: no `[L]` axis
        if unrolled:
            count = len({k.split(".")[1] for k in placement if k.startswith("layers.")})
            layers = {f"layers.{i}.{k}": spec.replace("(None, ", "(", 1)
                      for i in range(count) for k, spec in layer.items()}
        else:
            layers = {f"layers.{k}": spec for k, spec in layer.items()}
        expected = {**layers, "final_norm": "()", "embed": "('tp', None)",
                    "lm_head": "(None, 'tp')", "kv_pool.k": "(None, None, 'tp')"}
        assert {k: v["spec"] for k, v in placement.items()} == expected
        for name, p in placement.items():
            share = size if p["spec"] != "()" else 1
            assert p["local"] * share == p["total"], (name, size, p)


def test_every_mode_at_two_and_four_devices_equals_one(every_mode):
    check_modes(every_mode, SPEC_MODES, [2, 4])


def test_draws_on_a_cdf_boundary_do_not_depend_on_the_device_count(every_mode):
    """Softmax and the inverse CDF over logits split by vocabulary add each device's part,
    then the parts: a uniform on a CDF boundary (one device's) then draws another token on
    most rows. Gathered whole first (`whole_vocab`, as every step does before deciding),
    none does."""
    draws = every_mode["boundary_draws"]
    assert draws["split"] > 0, "split logits drew as one device does: the check has no teeth"
    assert draws["whole_vocab"] == 0, draws


def test_weights_and_pool_are_split_by_the_plan(every_mode):
    check_placement(every_mode, [2, 4])


def test_sizes_that_cannot_split_are_refused_by_name(every_mode):
    refusals = every_mode["refusals"]
    assert "tensor_parallel_size 3 does not divide the model's num_heads (4)" in refusals["3"]
    assert "tensor_parallel_size 8 needs 8 devices; 4 available" in refusals["8"]


def test_shipped_parallel_drafters_at_two_devices_equal_one():
    """PARD, DFlash and DSpark with the bundled target's trained drafters (2 KV heads: 2
    devices)."""
    modes = ["bundled_plain", "bundled_pard", "bundled_dflash", "bundled_dspark"]
    check_modes(tp_results(modes, [2]), modes, [2])
