"""The drafters shipped for the bundled target, the default speculation for a model, and the
`--speculative-config` command-line value every CLI (serve, generate, bench) parses alike."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from specjax.models.registry import BUNDLED, CHECKPOINTS_DIR
from specjax.speculative.config import AutoConfig, NGramConfig, SAConfig, SpeculativeConfig
from specjax.speculative.modes import MODE_NAMES, SpeculativeDecodingMode

M = SpeculativeDecodingMode
# The names `speculative_model` takes for the drafters shipped in `checkpoints/`
# (`specjax.models.registry.resolve_model_path` resolves them from any directory).
BUNDLED_DRAFT = "bundled-draft"
BUNDLED_EAGLE3 = "bundled-eagle3"
BUNDLED_MTP = "bundled-mtp"
BUNDLED_PARD = "bundled-pard"
BUNDLED_DFLASH = "bundled-dflash"
BUNDLED_DSPARK = "bundled-dspark"
# Per target name: the drafter each mode reads when none is named.
SHIPPED_FOR_MODEL = {
    "bundled": {M.DRAFT_TARGET_ONE_MODEL: BUNDLED_DRAFT, M.EAGLE3_ONE_MODEL: BUNDLED_EAGLE3,
                M.MTP: BUNDLED_MTP, M.PARD: BUNDLED_PARD, M.DFLASH: BUNDLED_DFLASH,
                M.DSPARK: BUNDLED_DSPARK},
    "smollm2": {M.EAGLE3_ONE_MODEL: "smollm2-eagle3", M.DFLASH: "smollm2-dflash"},
}
# Per target name, the modes its default (and AUTO) tries in order, the first whose drafter
# ships winning (NGram needs none: `EVIDENCE_NGRAM`): the order `python -m specjax.bench spec`
# measured (fastest first; README.md's tables give the figures). A target listed with no
# modes decodes fastest plainly: its default and AUTO do not speculate. SmolLM2: its EAGLE-3
# head ran at 0.86x plain decoding on this project's 2-core CPU (the cost model held it at
# D = 1), NGram asking for evidence at 0.96-1.0x on open chat and 1.2x on edits (README.md,
# "Drafters for SmolLM2").
# Gemma 3 270M (pretrained, completion): SA drafting D = 4 ran 1.47x plain decoding end to end
# over the bench's code, docstring, repetitive and HumanEval prompts, NGram D = 4 1.29x
# (docs/real-models.md, "Gemma 3 270M"); the cost model keeps SA's verify lengths short where
# its matches are not accepted.
DEFAULT_ORDER = {"bundled": (M.EAGLE3_ONE_MODEL, M.DRAFT_TARGET_ONE_MODEL),
                 "smollm2": (M.NGRAM,), "gemma3-270m": (M.SA,)}
# NGram that proposes only on evidence: a suffix match of at least 2 tokens whose proposed
# next token followed that pattern at least half the times it occurred. Chosen on answers
# SmolLM2 wrote to the training prompts (not the bench's): of the rules tried, it made the
# most tokens per unit of step cost on chat, code and edits alike (the reference's "any
# match" lost on chat). A private pool per request: nothing of one request's text steers
# another's drafts.
EVIDENCE_NGRAM = NGramConfig(max_draft_len=4, max_matching_ngram_size=4, is_keep_all=True,
                             is_use_oldest=True, is_public_pool=False,
                             min_matching_ngram_size=2, min_followed_ratio=0.5)

# One example per mode that --speculative-config takes by name (CLI help).
EXAMPLES = {
    "ngram": '{"mode": "ngram", "max_draft_len": 4, "max_matching_ngram_size": 3}',
    "sa": '{"mode": "sa", "max_draft_len": 8}',
    "draft_target": '{"mode": "draft_target", "max_draft_len": 4, '
                    '"speculative_model": "bundled-draft"}',
    "eagle3": '{"mode": "eagle3", "max_draft_len": 4, "speculative_model": "bundled-eagle3", '
              '"sa_config": {"threshold": 4}}',
    "mtp": '{"mode": "mtp", "max_draft_len": 3, "num_nextn_predict_layers": 3, '
           '"speculative_model": "bundled-mtp"}',
    "pard": '{"mode": "pard", "max_draft_len": 4, "speculative_model": "bundled-pard"}',
    "dflash": '{"mode": "dflash", "max_draft_len": 4, "speculative_model": "bundled-dflash"}',
    "dspark": '{"mode": "dspark", "max_draft_len": 4, "speculative_model": "bundled-dspark"}',
    "save_hidden_states": '{"mode": "save_hidden_states", "output_directory": "hs"}',
    "auto": '{"mode": "auto"}',
}
log = logging.getLogger("specjax")


def shipped_for(model: str | os.PathLike | None) -> dict:
    """mode -> the name of the drafter shipped for `model` (a target name), for those that
    ship; {} for any other model."""
    table = SHIPPED_FOR_MODEL.get(str(model), {}) if model is not None else {}
    return {mode: name for mode, name in table.items() if shipped(name)}


def shipped(name: str) -> str | None:
    """`name` ("bundled-eagle3", ...) when that drafter ships in `checkpoints/`, else None."""
    return name if (CHECKPOINTS_DIR / BUNDLED[name] / "config.json").exists() else None


def _mtp_modules(name: str) -> int:
    return json.loads((CHECKPOINTS_DIR / BUNDLED[name] / "config.json").read_text())[
        "num_nextn_predict_layers"]


def default_speculative_config(model: str | os.PathLike) -> SpeculativeConfig | None:
    """The fastest mode shipped for `model` (`DEFAULT_ORDER`, as `python -m specjax.bench spec`
    measured it): for the bundled target EAGLE-3 with its trained head, else draft-target;
    for SmolLM2 NGram asking for evidence (`EVIDENCE_NGRAM`); for Gemma 3 270M SA drafting;
    none for other models. Sampled
    requests use rejection sampling (the in-step drafters' default)."""
    drafters = shipped_for(model)
    for mode in DEFAULT_ORDER.get(str(model), ()):
        if mode is M.NGRAM:
            return EVIDENCE_NGRAM
        if mode is M.SA:
            return SAConfig(max_draft_len=4)
        if mode in drafters:
            return SpeculativeConfig.from_dict(_fill_shipped({"mode": mode.name.lower(),
                                                              "max_draft_len": 4}, model))
    return None


def resolve_auto(config: SpeculativeConfig | None, model: str | os.PathLike | None,
                 max_batch_size: int) -> SpeculativeConfig | None:
    """AutoConfig -> the concrete config it stands for (anything else unchanged): the drafter
    shipped for `model` (None: a model given as an instance, which ships none); None (plain
    decoding) for a target measured fastest without speculation (`DEFAULT_ORDER`); else the
    reference's NGram heuristic -- D = 5 and n-grams up to 3 for max_batch_size <= 4, D = 3
    and n-grams up to 5 above -- asking `EVIDENCE_NGRAM`'s evidence of a match; speculation
    off while more than `max_concurrency` requests run. The choice is logged."""
    if not isinstance(config, AutoConfig):
        return config
    chosen = default_speculative_config(model) if model is not None else None
    if chosen is None and model is not None and DEFAULT_ORDER.get(str(model)) == ():
        log.info("speculative_config AUTO -> none: %s measured fastest decoding plainly", model)
        return None
    if chosen is None:
        small = max_batch_size <= 4
        chosen = dataclasses.replace(EVIDENCE_NGRAM, max_draft_len=5 if small else 3,
                                     max_matching_ngram_size=3 if small else 5)
    if max_batch_size > config.max_concurrency:
        chosen = dataclasses.replace(chosen, draft_len_schedule={
            1: chosen.max_draft_len, config.max_concurrency + 1: 0})
    log.info("speculative_config AUTO -> %s", chosen)
    return chosen


def shipped_configs(max_draft_len: int, model: str | os.PathLike = "bundled"
                    ) -> list[SpeculativeConfig]:
    """NGram, then each drafter shipped for `model` (the bundled target: draft model, EAGLE-3
    head, MTP modules (MTP drafts at most one token per module), PARD, DFlash and DSpark; SmolLM2:
    EAGLE-3 and DFlash)."""
    D = max_draft_len
    configs: list[SpeculativeConfig] = [NGramConfig(max_draft_len=D, max_matching_ngram_size=3)]
    order = (M.DRAFT_TARGET_ONE_MODEL, M.EAGLE3_ONE_MODEL, M.MTP, M.PARD, M.DFLASH, M.DSPARK)
    drafters = shipped_for(model)
    for mode in (m for m in order if m in drafters):
        data = _fill_shipped({"mode": mode.name.lower(), "max_draft_len": D}, model)
        if mode is M.MTP:
            data["max_draft_len"] = min(D, data["num_nextn_predict_layers"])
            data["use_mtp_vanilla"] = True
        configs.append(SpeculativeConfig.from_dict(data))
    return configs


def with_shipped_drafter(config: SpeculativeConfig | None,
                         model: str | os.PathLike) -> SpeculativeConfig | None:
    """For a target with shipped drafters (the bundled one, SmolLM2), a config that names no
    drafter gets the one shipped for its mode; anything else is returned unchanged."""
    if (config is None or getattr(config, "speculative_model", "n/a") is not None
            or config.mode not in shipped_for(model)):
        return config
    return SpeculativeConfig.from_dict(_fill_shipped(config.to_dict(), model))


def _fill_shipped(data: dict, model: str | os.PathLike) -> dict:
    """A config dict naming no drafter, for a target with shipped drafters: the shipped drafter
    of its mode (for MTP also the module count, and a draft length it allows unless given)."""
    if data.get("speculative_model") is not None:
        return data
    try:
        mode = SpeculativeDecodingMode.parse(data.get("mode"))
    except ValueError:
        return data  # from_dict names the problem
    name = shipped_for(model).get(mode)
    if name is None:
        return data
    data = {**data, "speculative_model": name}
    if mode is M.MTP:
        n = _mtp_modules(name)
        data.setdefault("num_nextn_predict_layers", n)
        data.setdefault("max_draft_len", min(n, 4))
    return data


def parse_speculative_config(value: str | None,
                             model: str | os.PathLike) -> SpeculativeConfig | None:
    """--speculative-config: unset or "default" -> the default for `model`; "none" -> off; a
    mode name
    ("ngram", "eagle3", "draft_target", "mtp", ...: that mode's defaults); JSON
    (`SpeculativeConfig.to_json()`'s format, "mode" an integer or a name) or a file holding it.
    For a target with shipped drafters, a config naming no drafter gets the shipped one."""
    if value is None:
        return default_speculative_config(model)
    text = value.strip()
    if text.lower() == "none":
        return None
    if text.lower() == "default":
        return default_speculative_config(model)
    if text.lower().replace("-", "_") in MODE_NAMES or text.isdigit():
        data = {"mode": text}
    else:
        if not text.startswith("{"):
            path = Path(value).expanduser()
            if not path.is_file():
                raise ValueError(f"--speculative-config: {value!r} is neither 'none', a mode "
                                 f"name ({', '.join(EXAMPLES)}, ...), JSON, nor a file")
            text = path.read_text()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config: JSON must be an object with a \"mode\"")
    try:
        return SpeculativeConfig.from_dict(_fill_shipped(data, model))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--speculative-config: {e}") from None


def speculative_config_help(default: str) -> str:
    """The --speculative-config help every CLI shows: the forms it takes and one example
    per mode."""
    examples = "; ".join(f"{name}: '{example}'" for name, example in EXAMPLES.items())
    return (f"'none', 'default' (the model's), a mode name ({', '.join(EXAMPLES)}, ... -- "
            f"that mode's defaults, with "
            f"the shipped drafter for the bundled model or smollm2), JSON with \"mode\" as a name or "
            f"integer, or a file holding it (default: {default}). Examples: {examples}")
