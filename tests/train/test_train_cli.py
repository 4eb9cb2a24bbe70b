"""End to end through the command line on a fake, tiny standard library."""

import inspect
import json
import textwrap

import pytest

from specjax.train import corpus
from specjax.train.__main__ import main

TINY_FLAGS = ["--vocab-size", "300", "--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "8", "--ffn", "64", "--max-position", "128", "--steps", "3", "--batch-size", "2",
              "--seq-len", "16", "--warmup", "1", "--eval-windows", "2", "--no-progress"]


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "stdlib"
    source = inspect.getsource(textwrap)
    for i in range(30):  # mod28.py is in the validation split
        (root / f"mod{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"mod{i}.py").write_text(source[i * 400 : i * 400 + 1200])
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    return root


def test_train_resume_export_and_eval(fake_stdlib, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["target", "--out", str(out), *TINY_FLAGS, "--stop-after", "2"]) == 0
    assert not (out / "model.safetensors").exists()
    printed = capsys.readouterr().out
    # --no-progress: a line per log interval; the first has no rate yet (compilation), not None.
    assert "\nstep 2/3 loss " in printed and "None" not in printed
    assert main(["target", "--out", str(out), *TINY_FLAGS]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "corpus_manifest.json",
                 "MODEL_CARD.md", "training_log.json"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 0
    card = (out / "MODEL_CARD.md").read_text()
    assert "def fibonacci(n):" in card and "resumed" in card
    log = json.loads((out / "training_log.json").read_text())["entries"]
    assert [e["step"] for e in log if "loss" in e] == [2, 3]

    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    loss = printed.split("validation loss ")[1].split()[0]
    assert f"validation loss **{loss}**" in card


def test_draft_reuses_the_target_tokenizer_and_corpus(fake_stdlib, tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    assert main(["target", "--out", str(target), *TINY_FLAGS]) == 0
    # TINY_FLAGS[4:] drops the target's --vocab-size and --d-model: the draft picks its own width.
    assert main(["draft", "--target", str(target), "--out", str(draft), "--d-model", "16",
                 *TINY_FLAGS[4:]]) == 0
    for name in ("tokenizer.json", "corpus_manifest.json"):
        assert (draft / name).read_bytes() == (target / name).read_bytes()
    assert json.loads((draft / "config.json").read_text())["hidden_size"] == 16
    assert "a draft model for target" in (draft / "MODEL_CARD.md").read_text()


def test_draft_needs_a_target(tmp_path):
    with pytest.raises(SystemExit, match="tokenizer.json is missing"):
        main(["draft", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d"),
              *TINY_FLAGS])
