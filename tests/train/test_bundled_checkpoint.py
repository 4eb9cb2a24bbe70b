"""The shipped checkpoints: present, loadable, in budget, and doing what their cards and logs say.

Every figure is read from the shipped MODEL_CARD.md or training_log.json, never copied here, so a
re-exported checkpoint is checked against its own new card.
"""
import ast
import functools
import hashlib
import json
import platform
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import load_hf_checkpoint
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks
from tests.spec_checks import is_dense_greedy

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
BUNDLED = CHECKPOINTS / "stdlib-llama-7m"
LANGUAGE_MODELS = ["stdlib-llama-7m", "stdlib-draft"]

# The cards were written on CPU in full float32. One draft sample passes a top-2 logit gap of
# 4e-4 (the target's smallest is 0.02), which a GPU's default TF32 matmuls would flip.
full_precision = functools.partial(jax.default_matmul_precision, "highest")


@pytest.fixture(scope="module")
def target():
    return load_hf_checkpoint(BUNDLED)


def test_bundled_checkpoint_loads_and_predicts(target):
    cfg = target.config
    assert cfg.num_layers >= 8
    tok = toks.load_tokenizer(BUNDLED)
    assert cfg.vocab_size == tok.get_vocab_size()
    assert cfg.bos_token_id == cfg.eos_token_id == toks.special_token_id(tok)
    size = sum(p.stat().st_size for p in BUNDLED.glob("*.safetensors"))
    assert size <= 40 * 2**20
    for name in ("MODEL_CARD.md", "training_log.json", corpus.MANIFEST_NAME):
        assert (BUNDLED / name).exists()
    ids = [cfg.bos_token_id] + tok.encode("def fibonacci(n):\n").ids
    logits = target(jnp.asarray([ids], jnp.int32))
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


# -- helpers: the card, the log, the validation split ---------------------------------------------


def card(folder: Path) -> str:
    return (folder / "MODEL_CARD.md").read_text()


def training_log(folder: Path) -> dict:
    return json.loads((folder / "training_log.json").read_text())


def card_samples(folder: Path) -> list[tuple[str, int, str]]:
    """-> [(prompt, max new tokens, prompt + continuation)] from the card's greedy samples."""
    _, found, section = card(folder).partition("## Samples (greedy)\n")
    assert found, f"{folder.name}'s card has no greedy samples"
    sample = re.compile(r"^Prompt (.+?), then at most (\d+) greedy tokens:\n\n"
                        r"```python\n(.*?)\n```\n", re.DOTALL | re.MULTILINE)
    samples = [(ast.literal_eval(m[1]), int(m[2]), m[3]) for m in sample.finditer(section)]
    # Every sample must parse: one the pattern misses would otherwise go unchecked.
    assert samples and len(samples) == len(re.findall(r"^Prompt ", section, re.MULTILINE))
    return samples


@functools.cache
def validation_stream(folder: Path) -> np.ndarray:
    """The folder's validation split encoded as training encoded it; skips when this Python's
    stdlib does not hold exactly the files the manifest records."""
    manifest = corpus.load_manifest(folder / corpus.MANIFEST_NAME)
    root = corpus.stdlib_root()
    differ = [f.path for f in corpus.manifest_files(manifest, "val")
              if not (root / f.path).is_file()
              or hashlib.sha256((root / f.path).read_bytes()).hexdigest() != f.sha256]
    if differ:
        pytest.skip(f"{len(differ)} validation files of the manifest (Python "
                    f"{manifest['python_version']}) differ in this Python's stdlib "
                    f"({platform.python_version()}), e.g. {differ[0]}: its figures are not "
                    "comparable")
    tok = toks.load_tokenizer(folder)
    docs = corpus.read_documents(manifest, "val")
    return data.encode_stream(tok, docs, toks.special_token_id(tok))


def last_eval(log: dict) -> dict:
    evals = [e for e in log["entries"] if "val_loss" in e]
    # Only the final step's evaluation describes the exported weights.
    assert evals and evals[-1]["step"] == log["train_config"]["steps"]
    return evals[-1]


# -- target and draft: greedy samples, validation loss --------------------------------------------


def card_tokens_are_greedy(model, tok, prompt: str, max_new: int, text: str) -> bool:
    """Whether `greedy_continue(model, tok, prompt, max_new, ...)` gives `text` less `prompt`,
    proven with one dense forward (`is_dense_greedy`) over the continuation's encoding (and
    the EOS that ended it early): a loop of `max_new` forwards costs ~7 s of CPU a sample
    here. False when that encoding is not the greedy one (then the loop decides)."""
    cfg = model.config
    if not text.startswith(prompt):
        return False
    cont = text[len(prompt):]
    ids = [cfg.bos_token_id] + tok.encode(prompt, add_special_tokens=False).ids
    new = tok.encode(cont, add_special_tokens=False).ids
    if tok.decode(new, skip_special_tokens=False) != cont:
        return False
    if len(new) < max_new:  # greedy_continue drops the EOS that ended the sample
        new = new + [cfg.eos_token_id]
    return is_dense_greedy(model, ids, new, max_new, (cfg.eos_token_id,))


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_card_greedy_samples_reproduce(name, target):
    from specjax.train.evaluate import greedy_continue

    folder = CHECKPOINTS / name
    model = target if folder == BUNDLED else load_hf_checkpoint(folder)
    cfg, tok = model.config, toks.load_tokenizer(folder)
    with full_precision():
        for prompt, max_new, text in card_samples(folder):
            if card_tokens_are_greedy(model, tok, prompt, max_new, text):
                continue
            cont = greedy_continue(model, tok, prompt, max_new, bos_id=cfg.bos_token_id,
                                   eos_id=cfg.eos_token_id)
            assert prompt + cont == text, f"{name}: sample for {prompt!r}"


def test_the_one_forward_check_refuses_a_sample_greedy_does_not_give(target):
    """`card_tokens_are_greedy` is no rubber stamp: a card sample with one word changed, or
    cut short, is refused (greedy_continue would then decide, and disagree)."""
    tok = toks.load_tokenizer(BUNDLED)
    prompt, max_new, text = card_samples(BUNDLED)[0]
    with full_precision():
        assert card_tokens_are_greedy(target, tok, prompt, max_new, text)
        assert not card_tokens_are_greedy(target, tok, prompt, max_new,
                                          text.replace("return", "yield", 1))
        assert not card_tokens_are_greedy(target, tok, prompt, max_new, text[:-12])


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_logged_validation_loss_reproduces(name, target):
    """The last logged evaluation (the first `eval_windows` validation windows) is recomputed:
    the card's full-split loss would cost ~20 s of CPU, these 32 windows under 2 s."""
    from specjax.train.evaluate import loss_over_windows

    folder = CHECKPOINTS / name
    stream = validation_stream(folder)
    # The card's token count pins the tokenizer and the files together.
    tokens = re.search(r"held-out files[^(]*\(([\d,]+) tokens\)", card(folder))
    assert tokens and int(tokens[1].replace(",", "")) == len(stream)
    log = training_log(folder)
    tc, logged = log["train_config"], last_eval(log)
    windows = data.eval_windows(stream, tc["seq_len"], tc["eval_windows"])
    assert len(windows) == tc["eval_windows"]
    model = target if folder == BUNDLED else load_hf_checkpoint(folder)
    with full_precision():
        loss = loss_over_windows(model, windows)
    # Measured equal to 1e-7 on CPU; 1e-4 allows another backend's summation order. The step
    # before the last one already differs by ~0.02 (the target's log: 3.735 at 1200, 3.717).
    assert loss == pytest.approx(logged["val_loss"], abs=1e-4)


# -- draft heads: the figures of their cards ------------------------------------------------------


def head_spec(log: dict):
    from specjax.train.heads.spec import HeadSpec

    fields = dict(log["head_spec"])
    fields["capture_layers"] = tuple(fields["capture_layers"])
    return HeadSpec(**fields)


def val_source():
    from specjax.train.heads.sources import CorpusSource

    # The heads were trained and reported on their target's corpus (the cards say so).
    return CorpusSource(np.zeros((2,), np.int32), validation_stream(BUNDLED))


def test_eagle3_card_validation_figures_reproduce(target):
    """The card's acceptance table would cost ~100 s of CPU here (a tree-masked target forward
    per depth over 32 windows); the card's and log's validation figures cost ~9 s."""
    from specjax.models.eagle3_checkpoint import load_eagle3_head
    from specjax.train.heads.training import validation_metrics

    folder = CHECKPOINTS / "stdlib-eagle3"
    log = training_log(folder)
    tc, logged = log["train_config"], last_eval(log)
    stated = re.search(r"final validation loss ([\d.]+) \(first (\d+) windows\)", card(folder))
    assert stated and int(stated[2]) == tc["eval_windows"]
    batches = val_source().val_batches(tc["batch_size"], tc["seq_len"], tc["eval_windows"])
    with full_precision():
        got = validation_metrics(head_spec(log), load_eagle3_head(folder), target, batches)
    # The head ships in float32, as trained: measured equal to the log to 1e-6. 1e-4 allows
    # another backend's summation order; the card rounds to 4 decimals (5e-5 more).
    assert got["val_loss"] == pytest.approx(logged["val_loss"], abs=1e-4)
    assert got["val_loss"] == pytest.approx(float(stated[1]), abs=1.5e-4)
    assert got["val_kl"] == pytest.approx(logged["val_kl"], abs=1e-4)
    # One of the 4,096 anchors flipping moves a rate by 2.4e-4; allow a few on another backend.
    assert got["val_step_acc"] == pytest.approx(logged["val_step_acc"], abs=1e-3)


def card_acceptance(text: str) -> tuple[list[tuple[int, float, float, int]], float, int]:
    """-> ([(depth, agreement, conditional, reached)], E[AL], anchors) from a head's card."""
    rows = [(int(d), float(a), float(c), int(r)) for d, a, c, r in
            re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$", text, re.MULTILINE)]
    eal = re.search(r"E\[AL\] = \*\*([\d.]+)\*\* at depth (\d+) over ([\d,]+) validation anchors",
                    text)
    assert rows and eal and [r[0] for r in rows] == list(range(1, int(eal[2]) + 1))
    return rows, float(eal[1]), int(eal[3].replace(",", ""))


def test_mtp_card_acceptance_reproduces(target):
    """The card's acceptance table, recomputed over the same validation windows (~7 s)."""
    from specjax.models.mtp_checkpoint import load_mtp_heads
    from specjax.train.heads.report import acceptance_report

    folder = CHECKPOINTS / "stdlib-mtp"
    log = training_log(folder)
    rows, eal, anchors = card_acceptance(card(folder))
    tc = log["train_config"]
    batches = val_source().val_batches(min(tc["batch_size"], 4), tc["seq_len"],
                                       log["args"]["report_windows"])
    with full_precision():
        report = acceptance_report(head_spec(log), load_mtp_heads(folder, target.config),
                                   target, batches)
    assert report["anchors"] == anchors
    # The card was computed from the float32 head before export; the shipped weights are its
    # bfloat16 rounding, which flipped 2 of 8,128 depth-1 anchors (rates moved by <= 6e-4,
    # reached counts by <= 4, E[AL] by 9e-4). The card prints 3 decimals (5e-4 of rounding).
    for (depth, agreement, conditional, reached), got in zip(rows, report["per_depth"],
                                                             strict=True):
        assert got["depth"] == depth
        assert got["agreement"] == pytest.approx(agreement, abs=3e-3), depth
        assert got["conditional_agreement"] == pytest.approx(conditional, abs=3e-3), depth
        assert got["reached"] == pytest.approx(reached, rel=5e-3), depth
    assert report["expected_acceptance_length"] == pytest.approx(eal, abs=5e-3)


def test_shipped_drafters_and_checkpoints_fit_their_budgets():
    """The bundled target's drafters <= 8 MB each, any other shipped head <= 24 MB (the head
    exporter's limit), all of checkpoints/ <= 80 MB (the project's budget)."""
    folder_bytes = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    for name in ("stdlib-draft", "stdlib-eagle3", "stdlib-mtp", "stdlib-pard", "stdlib-dflash",
                 "stdlib-dspark"):
        assert (CHECKPOINTS / name / "config.json").exists(), name
        assert folder_bytes(CHECKPOINTS / name) <= 8_000_000, name
    for folder in CHECKPOINTS.iterdir():
        if folder.name != "stdlib-llama-7m":
            assert folder_bytes(folder) <= 24_000_000, folder.name
    assert folder_bytes(CHECKPOINTS) <= 80_000_000


def test_smollm2_head_card_states_its_logged_report_and_its_data_avoid_the_bench():
    """The SmolLM2 head was trained on an H200 from data that is not here: its card carries
    its training log's report, it loads in the public EAGLE-3 layout, and none of its
    training prompts shares a 6-word run with the bench's held-out requests."""
    from specjax.analysis.heldout import overlaps_heldout
    from specjax.models.eagle3_checkpoint import load_eagle3_head
    folder = CHECKPOINTS / "smollm2-eagle3"
    rows, eal, anchors = card_acceptance(card(folder))
    report = training_log(folder)["report"]
    assert report["expected_acceptance_length"] == pytest.approx(eal, abs=5e-4)
    assert report["anchors"] == anchors and len(rows) == 4
    config = load_eagle3_head(folder).config
    assert (config.draft_vocab_size, tuple(config.aux_hidden_state_layers)) == (8192, (1, 14, 26))
    manifest = json.loads((folder / "data_manifest.json").read_text())
    assert manifest["prompts"] == len(manifest["prompt_texts"]) > 1000
    assert not any(overlaps_heldout(p["text"]) for p in manifest["prompt_texts"])


def test_parallel_drafter_cards_state_their_block_report():
    """PARD and DFlash cards carry the exact block report of their trainer (greedy, block of
    D) and the logged E[AL] matches the card's."""
    for name in ("stdlib-pard", "stdlib-dflash"):
        folder = CHECKPOINTS / name
        rows, eal, anchors = card_acceptance(card(folder))
        report = training_log(folder)["report"]
        assert report["expected_acceptance_length"] == pytest.approx(eal, abs=5e-4)
        assert report["anchors"] == anchors and len(rows) == report["depth"]
        assert "block of" in card(folder)


def test_dspark_card_states_its_calibrated_report(target):
    """The DSpark card carries its trainer's sequential block report with the calibrated
    confidence per position (matching the log), and the folder loads as a DSparkHead whose
    fitted calibration is the log's (not the identity), confidence in float32."""
    from specjax.models import load_dflash_head
    from specjax.models.dspark_head import DSparkHead, identity_calibration
    folder = CHECKPOINTS / "stdlib-dspark"
    text = card(folder)
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|",
                      text, re.MULTILINE)
    eal = re.search(r"E\[AL\] = \*\*([\d.]+)\*\* at depth (\d+) over ([\d,]+) validation "
                    r"anchors", text)
    report = training_log(folder)["report"]
    assert eal and report["expected_acceptance_length"] == pytest.approx(float(eal[1]), abs=5e-4)
    assert report["anchors"] == int(eal[3].replace(",", "")) and len(rows) == report["depth"]
    for (d, a, c, r, pred, diff), got in zip(rows, report["per_depth"]):
        assert (int(d), int(r)) == (got["depth"], got["reached"])
        assert float(a) == pytest.approx(got["agreement"], abs=5e-4)
        assert float(c) == pytest.approx(got["conditional_agreement"], abs=5e-4)
        assert float(pred) == pytest.approx(got["predicted_confidence"], abs=5e-4)
        assert float(diff) == pytest.approx(got["calibration_error"], abs=5e-4)
    head = load_dflash_head(folder, target.config)
    assert isinstance(head, DSparkHead) and head.config.block_size == report["depth"]
    cal = np.asarray(head.calibration[...])
    assert cal.dtype == np.float32 and head.confidence[...].dtype == jnp.float32
    assert not np.allclose(cal, np.asarray(identity_calibration(report["depth"])))
    np.testing.assert_allclose(cal[0], [d["greedy_pair"] for d in report["per_depth"]],
                               rtol=1e-6)
