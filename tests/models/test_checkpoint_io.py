"""Exported safetensors files get ordinary permissions (0o666 masked by the umask, like any file
`open(..., "w")` creates), not the 0600 of safetensors' private temp file, and every writer in
specjax goes through the one function that sees to it."""
import ast
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.engine.hidden_states import HiddenStateRecorder, load_hidden_states
from specjax.models import Llama, ModelConfig, read_safetensors, save_hf_checkpoint
from specjax.models.checkpoint_io import save_safetensors
from specjax.models.eagle3_checkpoint import save_eagle3_head
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.mtp_checkpoint import save_mtp_heads
from specjax.models.mtp_head import MTPHeads

CONFIG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=32)
# 0o077 is left out on purpose: it would give 0600, the very mode of the bug.
UMASKS = (0o022, 0o002, 0o027)


@pytest.fixture(params=UMASKS, ids=oct)
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_save_safetensors_mode_follows_the_umask(umask, tmp_path):
    path = save_safetensors({"a": np.arange(6, dtype=np.float32).reshape(2, 3)},
                            tmp_path / "x.safetensors", metadata={"format": "pt"})
    assert mode(path) == 0o666 & ~umask
    np.testing.assert_array_equal(read_safetensors(tmp_path)["a"], np.arange(6).reshape(2, 3))


def test_overwriting_a_0600_file_gives_the_normal_mode(umask, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)
    save_safetensors({"a": np.zeros(2, np.float32)}, path)
    assert mode(path) == 0o666 & ~umask


def test_every_exporter_writes_normal_permissions(umask, tmp_path):
    save_hf_checkpoint(Llama(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "target")
    head_config = Eagle3HeadConfig(hidden_size=16, intermediate_size=24, num_heads=4,
                                   num_kv_heads=2, head_dim=4, vocab_size=40, draft_vocab_size=40)
    save_eagle3_head(Eagle3Head(head_config, nnx.Rngs(0)), tmp_path / "eagle3")
    save_mtp_heads(MTPHeads(CONFIG, 1, nnx.Rngs(0)), tmp_path / "mtp")
    recorder = HiddenStateRecorder(
        SimpleNamespace(output_directory=tmp_path / "hs", file_prefix="hs", write_interval=1),
        layers=(0, 1))
    request = SimpleNamespace(request_id=7, all_ids=[1, 2, 3, 4])
    recorder.record(request, 0, np.ones((2, 3, 16), np.float32))
    recorder.finish(request)
    written = recorder.flush()
    assert load_hidden_states(written)[0] == (0, 1)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert [f.parent.name for f in files] == ["eagle3", "hs", "mtp", "target"]
    assert {f.name: oct(mode(f)) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}


def test_no_module_writes_safetensors_but_checkpoint_io():
    """safetensors' own writers leave 0600: only `save_safetensors` may call them."""
    root = Path(specjax.__file__).parent
    writers = {"save_file", "save", "save_model"}
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "checkpoint_io.py" and path.parent.name == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safetensors"):
                offenders += [f"{path.relative_to(root)}: {a.name}" for a in node.names
                              if a.name in writers]
    assert not offenders
