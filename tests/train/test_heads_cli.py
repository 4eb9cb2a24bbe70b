"""`python -m specjax.train eagle3|mtp|pard|dflash|dspark` end to end on a tiny target folder."""
import inspect
import json
import textwrap

import pytest
from flax import nnx

from head_helpers import TARGET, random_fill
from specjax.models import Llama, save_hf_checkpoint
from specjax.models import load_dflash_head, load_hf_checkpoint, read_mask_token
from specjax.models.eagle3_checkpoint import load_eagle3_head
from specjax.models.mtp_checkpoint import load_mtp_heads
from specjax.train import corpus
from specjax.train import tokenizer_training as toks
from specjax.train.__main__ import main


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny target folder as `train target` writes it: weights, tokenizer, corpus manifest."""
    root = tmp_path_factory.mktemp("stdlib")
    source = inspect.getsource(textwrap)
    for i in range(30):  # mod28.py lands in the validation split
        (root / f"mod{i}.py").write_text(source[i * 400: i * 400 + 1200])
    folder = tmp_path_factory.mktemp("target")
    manifest = corpus.build_manifest(root)
    corpus.write_manifest(manifest, folder / corpus.MANIFEST_NAME)
    tok = toks.train_tokenizer(corpus.read_documents(manifest, "train", root), 300)
    toks.save_tokenizer(tok, folder)
    config = TARGET.replace(vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_id=0)
    save_hf_checkpoint(random_fill(Llama(config, rngs=nnx.Rngs(0)), seed=0, scale=0.1), folder)
    return folder, root, config


CLI_FLAGS = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
             "--eval-windows", "2", "--report-windows", "2", "--no-progress", "--depth", "2"]


def test_cli_eagle3_end_to_end(target_folder, tmp_path, monkeypatch, capsys):
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "eagle3"
    assert main(["eagle3", "--target", str(folder), "--out", str(out), "--draft-vocab", "200",
                 *CLI_FLAGS]) == 0
    head = load_eagle3_head(out)
    assert head.config.draft_vocab_size == 200 and head.config.vocab_size == config.vocab_size
    assert json.loads((out / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # the default for 8 layers
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    assert size <= 10_000_000
    log = json.loads((out / "training_log.json").read_text())
    assert log["report"]["depth"] == 2 and log["commands"][-1].startswith(
        "python -m specjax.train eagle3 --target")
    printed = capsys.readouterr().out
    assert "E[AL]" in printed and "\nstep 3/3 loss " in printed and "None" not in printed
    assert "E[AL]" in (out / "MODEL_CARD.md").read_text()


def test_cli_mtp_end_to_end(target_folder, tmp_path, monkeypatch):
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "mtp"
    assert main(["mtp", "--target", str(folder), "--out", str(out), "--num-modules", "2",
                 *CLI_FLAGS]) == 0
    heads_ = load_mtp_heads(out, config)
    assert heads_.num_modules == 2
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sum(f.stat().st_size for f in out.iterdir() if f.is_file()) <= 10_000_000
    assert json.loads((out / "training_log.json").read_text())["report"]["depth"] == 2



def test_cli_pard_end_to_end(target_folder, tmp_path, monkeypatch, capsys):
    """A PARD folder: a Llama with one more embedding row (the mask token, named in
    config.json), the target's tokenizer, the block report and a model card."""
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "pard"
    assert main(["pard", "--target", str(folder), "--out", str(out), "--drafter-layers", "2",
                 *CLI_FLAGS]) == 0
    model = load_hf_checkpoint(out)
    assert model.config.vocab_size == config.vocab_size + 1 and model.config.num_layers == 2
    assert read_mask_token(out) == config.vocab_size
    assert (out / toks.TOKENIZER_NAME).exists()
    assert "block of 2" in capsys.readouterr().out
    card = (out / "MODEL_CARD.md").read_text()
    assert "PARDConfig(max_draft_len=2" in card and "E[AL]" in card


def test_cli_dflash_end_to_end(target_folder, tmp_path, monkeypatch):
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "dflash"
    assert main(["dflash", "--target", str(folder), "--out", str(out), "--layers", "1,5,7",
                 *CLI_FLAGS]) == 0
    head = load_dflash_head(out, config)
    assert head.config.target_layer_ids == (1, 5, 7) and head.config.num_layers == 2
    assert head.config.mask_token_id == config.vocab_size and head.config.block_size == 2
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "DFlashConfig(max_draft_len=2" in (out / "MODEL_CARD.md").read_text()


def test_cli_dspark_end_to_end(target_folder, tmp_path, monkeypatch, capsys):
    """A DSpark folder: DFlash's layout plus the Markov and confidence heads; the report drafts
    sequentially and the exported calibration is the fitted one (not the identity)."""
    import numpy as np
    from safetensors import safe_open
    from specjax.models.dspark_head import DSparkHead, identity_calibration
    folder, root, config = target_folder
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    out = tmp_path / "dspark"
    assert main(["dspark", "--target", str(folder), "--out", str(out), "--layers", "1,5,7",
                 "--markov-rank", "16", *CLI_FLAGS]) == 0
    head = load_dflash_head(out, config)
    assert isinstance(head, DSparkHead) and head.config.markov_rank == 16
    assert head.config.target_layer_ids == (1, 5, 7) and head.config.block_size == 2
    assert not np.allclose(np.asarray(head.calibration[...]), np.asarray(identity_calibration(2)))
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes.pop("confidence.weight") == dtypes.pop("confidence.calibration") == "F32"
    assert set(dtypes.values()) == {"BF16"}
    log = json.loads((out / "training_log.json").read_text())
    depth1 = log["report"]["per_depth"][0]
    assert {"predicted_confidence", "calibration_error", "greedy_pair"} <= depth1.keys()
    assert log["head_spec"]["markov_rank"] == 16 and "step_tv" in log["entries"][0]
    card = (out / "MODEL_CARD.md").read_text()
    assert "DSparkConfig(max_draft_len=2" in card and "predicted c" in card and "E[AL]" in card
    assert "predicted c" in capsys.readouterr().out


def test_cli_data_then_eagle3_from_its_hidden_states(target_folder, tmp_path):
    """`train data` answers locally made prompts with the target and saves the hidden states
    an EAGLE-3 head then trains on (exported in bfloat16 when asked)."""
    from safetensors import safe_open
    from specjax.analysis.heldout import overlaps_heldout
    from specjax.engine.hidden_states import read_hidden_states
    folder, _, config = target_folder
    data = tmp_path / "data"
    assert main(["data", "--target", str(folder), "--out", str(data), "--limit", "5",
                 "--self-instruct", "2", "--max-tokens", "6", "--batch-size", "4",
                 "--answers", "2", "--layers", "1,3,4,7"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    layers, requests = read_hidden_states(data / "hidden")
    assert layers == (1, 3, 4, 7) and manifest["layers"] == [1, 3, 4, 7]
    # Every answer (two per prompt) and each self-instruct question request is saved, whole
    # (a request too long for this target's 128-token context is left out, and counted).
    assert manifest["prompts"] == 5 and manifest["answers"] == 10
    assert 1 <= manifest["self_instruct"]["asked"] <= 2
    assert len(requests) == 10 + manifest["self_instruct"]["asked"]
    assert not any(overlaps_heldout(p["text"]) for p in manifest["prompt_texts"])
    assert sum(manifest["answers_by_source"].values()) == 10
    # A spent time budget submits no more prompts, and the manifest says what was answered.
    spent = tmp_path / "spent"
    assert main(["data", "--target", str(folder), "--out", str(spent), "--limit", "5",
                 "--self-instruct", "0", "--max-tokens", "6", "--batch-size", "4",
                 "--max-seconds", "0"]) == 0
    manifest = json.loads((spent / "manifest.json").read_text())
    assert manifest["answers"] == 0 and manifest["prompts"] == 0 and manifest["prompts_made"] == 5
    # --resume continues it with the same settings (other ones are refused before loading):
    # the answers not yet written, into new files, the manifest counting both sessions.
    with pytest.raises(SystemExit, match="max_tokens"):
        main(["data", "--target", str(folder), "--out", str(spent), "--limit", "5",
              "--self-instruct", "0", "--max-tokens", "7", "--resume"])
    with pytest.raises(SystemExit, match="already holds files"):
        main(["data", "--target", str(folder), "--out", str(data), "--limit", "5"])
    assert main(["data", "--target", str(folder), "--out", str(spent), "--limit", "5",
                 "--self-instruct", "0", "--max-tokens", "6", "--batch-size", "4",
                 "--resume"]) == 0
    manifest = json.loads((spent / "manifest.json").read_text())
    assert (manifest["sessions"], manifest["answers"], manifest["prompts"]) == (2, 5, 5)
    assert all(f.startswith("part001_") for f in manifest["files"])
    assert len(read_hidden_states(spent / "hidden")[1]) == 5
    out = tmp_path / "eagle3"
    assert main(["eagle3", "--target", str(folder), "--out", str(out), "--hidden-states",
                 str(data / "hidden"), "--draft-vocab", "100", "--save-dtype", "bfloat16",
                 *CLI_FLAGS]) == 0
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()
                if k not in ("d2t", "t2d")} == {"BF16"}
    assert load_eagle3_head(out).config.draft_vocab_size == 100
    assert "bfloat16" in (out / "MODEL_CARD.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--answers", "2", "--temperature", "0"], "greedy answers to the same prompt"),
    (["--answers", "0"], "--answers must be >= 1"),
])
def test_cli_data_refuses_answers_that_add_nothing_before_loading(tmp_path, flags, message):
    """Repeated greedy answers would be copies; no answers is no data: both are refused before
    any model loads (the target named here does not exist)."""
    with pytest.raises(SystemExit) as e:
        main(["data", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "d"),
              *flags])
    assert message in str(e.value)
    assert not (tmp_path / "d").exists()
