"""Which XLA flags specjax sets is decided from what is installed, before JAX's backend starts:
the GPU set where a GPU plugin is (and JAX_PLATFORMS allows it), the CPU set elsewhere; flags
the user set stay the user's."""
import sys

import pytest

from specjax import xla_flags


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    """A `jax_plugins` namespace holding the named plugin modules (and nothing installed)."""
    def make(*names):
        root = tmp_path / "site"
        for name in names:
            (root / "jax_plugins" / name).mkdir(parents=True)
            (root / "jax_plugins" / name / "__init__.py").write_text("")
        (root / "jax_plugins").mkdir(parents=True, exist_ok=True)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    return make


def test_a_cuda_plugin_means_the_gpu_flags(fake_plugins, monkeypatch):
    fake_plugins("xla_cuda12")
    assert xla_flags.gpu_plugin_installed()
    monkeypatch.setattr(xla_flags, "GPU_FLAGS", ("--xla_gpu_a=1",))
    monkeypatch.setattr(xla_flags, "CPU_FLAGS", ("--xla_cpu_b=1",))
    assert xla_flags.default_flags() == ("--xla_gpu_a=1",)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the user ruled the GPU out
    assert not xla_flags.gpu_plugin_installed()
    assert xla_flags.default_flags() == ("--xla_cpu_b=1",)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert xla_flags.gpu_plugin_installed()


def test_other_plugins_are_not_a_gpu(fake_plugins):
    fake_plugins("some_tpu_thing")
    assert not xla_flags.gpu_plugin_installed()


def test_apply_adds_the_platform_flags_and_keeps_the_users(fake_plugins, monkeypatch):
    fake_plugins("xla_cuda13")
    monkeypatch.setattr(xla_flags, "GPU_FLAGS", ("--xla_gpu_a=1", "--xla_gpu_b=2"))
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_b=7")
    monkeypatch.setenv("SPECJAX_EXTRA_XLA_FLAGS", "--xla_gpu_c=3")
    xla_flags.apply()
    assert xla_flags.os.environ["XLA_FLAGS"].split() == ["--xla_gpu_b=7", "--xla_gpu_a=1",
                                                         "--xla_gpu_c=3"]


def test_every_gpu_candidate_is_a_flag_set_jaxlib_accepts():
    """XLA parses every XLA_FLAGS entry when its backend starts, on any platform (GPU debug
    options included), and aborts on one it does not know: a misspelt candidate would cost a
    GPU session its child run. Each candidate starts a CPU backend here."""
    import os
    import subprocess

    from specjax.bench.xla import GPU_CANDIDATES
    flags = " ".join(f for f in GPU_CANDIDATES if f)
    for candidate in [flags, "--xla_gpu_enable_command_buffer_typo=+WHILE"]:
        env = dict(os.environ, XLA_FLAGS=candidate, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).sum()"],
                              env=env, capture_output=True, text=True)
        assert (proc.returncode == 0) == ("typo" not in candidate), (candidate, proc.stderr)
