"""The export folder of a trained head: weights (written by the kind's exporter), the training
log, the model card, and the size check every shipped head must pass."""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Callable

import jax

from specjax.train.heads.spec import HeadSpec
from specjax.train.workdir import LOG_NAME, hardware, wall_seconds

# Every shipped head folder stays under this: checkpoints/ holds at most 80 MB in all.
SIZE_LIMIT_BYTES = 24_000_000


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def check_size(folder: Path, limit: int = SIZE_LIMIT_BYTES) -> int:
    size = folder_bytes(folder)
    if size > limit:
        raise SystemExit(f"{folder} holds {size / 1e6:.2f} MB > the {limit / 1e6:.0f} MB limit for "
                         "a shipped head (use a smaller --draft-vocab or --save-dtype bfloat16)")
    return size


def export_head(out: Path, head, target, spec: HeadSpec, args: argparse.Namespace, log: dict,
                table: str, export_fn: Callable) -> int:
    """Replace the folder's previous export; -> its size in bytes (checked against the limit).
    export_fn(out, head, target, spec, log) writes the weights (and may add to the log)."""
    for name in ("model.safetensors", "config.json", "MODEL_CARD.md", LOG_NAME):
        (out / name).unlink(missing_ok=True)
    export_fn(out, head, target, spec, log)
    (out / LOG_NAME).write_text(json.dumps(log, indent=0) + "\n")
    write_model_card(out, spec, args, log, table)
    return check_size(out)


def write_model_card(out: Path, spec: HeadSpec, args: argparse.Namespace, log: dict,
                     table: str) -> None:
    tc = log["train_config"]
    done = log.get("steps_done", tc["steps"])
    wall = wall_seconds(log["entries"])
    val = next((e for e in reversed(log["entries"]) if "val_loss" in e), None)
    if spec.kind == "eagle3":
        what = (f"an EAGLE-3 draft head for `{Path(args.target).name}`: fc over the target's residual "
                f"streams after layers {list(spec.capture_layers)} (0-based), one decoder "
                f"midlayer, a {spec.draft_vocab}-token draft vocabulary"
                + (" (the whole target vocabulary)" if spec.draft_vocab == log["vocab_size"]
                   else " (the most frequent training tokens; `d2t`/`t2d` map them)"))
        files = ("public EAGLE-3 layout (`config.json` + `model.safetensors`, "
                 f"{log['save_dtype']})")
        use = (f"EagleConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\", "
               f"eagle3_layers_to_capture={tuple(spec.capture_layers)})")
        training = (f"training-time test: the head's chain unrolled over {spec.depth} steps as "
                    "the engine drafts it (step j attends to the step-1 keys of the accepted "
                    "prefix plus the chain's own keys)")
    elif spec.kind == "pard":
        what = (f"a PARD draft model for `{Path(args.target).name}` (any target of its tokenizer): a "
                f"{spec.drafter_layers}-layer causal LM shaped like the target's layers, its "
                "vocabulary plus one mask token (`pard_token` in config.json), started from the "
                f"target's embeddings and first {spec.drafter_layers} layers")
        files = (f"a Hugging Face Llama folder (`config.json` with `pard_token`, "
                 f"`model.safetensors` in {log['save_dtype']}, `tokenizer.json`)")
        use = f"PARDConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")"
        training = (f"the PARD objective: at every anchor the prefix and {spec.depth - 1} mask "
                    "tokens, row k after the prefix predicting the token k ahead")
    elif spec.kind == "dspark":
        what = (f"a DSpark drafter for `{Path(args.target).name}`: a DFlash drafter "
                f"({spec.drafter_layers} decoder layers shaped like the target's, started from "
                f"its first ones, fc over the target's residual streams after layers "
                f"{list(spec.capture_layers)} (0-based) injected as keys and values into every "
                f"layer; the embeddings and LM head are the target's) plus a rank-"
                f"{spec.markov_rank} Markov head (each draft's logits get a term of the token "
                "before it, so the block is drafted one token at a time after the one pass) and "
                "a confidence head with a per-position logistic calibration of its logit and the "
                "drafter's certainty (greedy and sampled)")
        files = (f"`config.json` + `model.safetensors` in the layout of "
                 f"`specjax.models.dflash_checkpoint`, architecture SpecjaxDSparkDrafter "
                 f"({log['save_dtype']}; the confidence head and its calibration float32)")
        use = f"DSparkConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")"
        training = (f"every position an anchor: the block [token, mask x {spec.depth}] sees the "
                    "context before it and itself (bidirectionally), block row k labelled with "
                    "the target's distribution k - 1 rows on; the Markov head reads the TRUE "
                    "previous token (one pass, teacher-forced)")
    elif spec.kind == "dflash":
        what = (f"a DFlash drafter for `{Path(args.target).name}`: {spec.drafter_layers} decoder "
                f"layers shaped like the target's (started from its first ones), fc over the "
                f"target's residual streams after layers {list(spec.capture_layers)} (0-based) "
                "injected as keys and values into every layer; the embeddings and LM head are "
                "the target's")
        files = (f"`config.json` + `model.safetensors` in the layout of "
                 f"`specjax.models.dflash_checkpoint` ({log['save_dtype']})")
        use = f"DFlashConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")"
        training = (f"every position an anchor: the block [token, mask x {spec.depth}] sees the "
                    "context before it and itself (bidirectionally), block row k labelled with "
                    "the target's distribution k - 1 rows on")
    else:
        modules = ("an MTP-Eagle module (one module reused for every draft step)"
                   if spec.num_modules == 1
                   else f"{spec.num_modules} MTP modules (module k drafts token k)")
        what = (f"{modules} for `{Path(args.target).name}`, each a target-style decoder layer on "
                "eh_proj(concat(enorm(embedding), hnorm(hidden))); the LM head is the target's")
        files = (f"`config.json` + `model.safetensors` in the specjax MTP layout "
                 f"(`specjax.models.mtp_checkpoint`, {log['save_dtype']})")
        use = (f"MTPConfig(max_draft_len={spec.depth}, num_nextn_predict_layers="
               f"{spec.num_modules}, use_mtp_vanilla={spec.num_modules > 1}, "
               f"speculative_model=\"{out}\")")
        training = ("training-time test over the reused module's chain" if spec.chain
                    else "the dense MTP chain (module k reads module k-1's hidden state)")
    lines = [
        f"# {out.name}: {spec.label} draft head for {Path(args.target).name}\n",
        f"{what[0].upper()}{what[1:]}. Trained by `specjax.train` on the frozen target's own "
        "predictions; the target's weights are unchanged.\n",
        "## Files\n",
        f"- weights: {files}; {folder_bytes(out) / 1e6:.1f} MB in all "
        f"(the exporter refuses more than {SIZE_LIMIT_BYTES / 1e6:.0f} MB)",
        f"- use: `specjax.LLM(\"{args.target}\", speculative_config={use})`",
        "- `training_log.json`: arguments, loss curve, the report below\n",
        "## Training\n",
        f"- command: `{log['commands'][-1]}`",
        *(["- resumed; invocations in order: " + "; ".join(f"`{c}`" for c in log["commands"])]
          if len(log["commands"]) > 1 else []),
        f"- data: {log['data']}",
        (f"- labels: the target's next-token distribution; {training}; DeepSpec's loss: draft "
         "k weighted exp(-(k-1)/4) x [0.1 soft cross-entropy + 0.9 L1 between the draft's and "
         "the target's distributions + BCE(sigmoid(z_k), 1 - TV)] (TV = half the L1, a "
         "stop-gradient label)" if spec.kind == "dspark" else
         f"- labels: the target's next-token distribution (soft cross-entropy); {training}; "
         f"step j weighted {spec.step_weight}^(j-1)"),
        f"- {done} steps of {tc['batch_size']} x {tc['seq_len']} tokens"
        + (f" (of {tc['steps']} planned: the time budget ended the run)" if done < tc["steps"]
           else "") + f"; AdamW (b1 "
        f"{tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), peak lr {tc['lr']:g}, "
        f"{tc['warmup']} warm-up steps, cosine to {tc['lr'] * tc['min_lr_ratio']:g}, clip "
        f"{tc['clip_norm']}",
        f"- hardware: {hardware()}, JAX {jax.__version__}"
        + (f", {wall / 60:.0f} min wall time" if wall else ""),
        *([f"- final validation loss {val['val_loss']:.4f} (first {tc['eval_windows']} windows)"]
          if val else []),
        "\n## Acceptance (validation split)\n",
        "Greedy decoding: depth k agrees when the head's top-1 token equals the target's own "
        "argmax choice k tokens ahead; conditional agreement is over anchors whose depths "
        "1..k-1 all agreed; E[AL] = 1 + mean number of leading agreeing depths (tokens per "
        "target step).\n",
        *([("DSpark drafts the block one token at a time (x_k = argmax(base_k + markov(x_{k-1})), "
            "x_0 the anchor), as the engine does; the confidence z_k reads the drafted x_{k-1}. "
            "Predicted c: the mean calibrated confidence (greedy rule) over the anchors that "
            "reach depth k, against the measured conditional agreement; the per-position maps "
            "sigmoid(scale z + bias + gain u) (u: the drafter's largest log-probability) were "
            "fitted on these same anchors (held-out |diff|: a two-fold cross-fit). "
            "1 - TV: the mean acceptance probability of rejection sampling at temperature 1 "
            "(the sampled rule's label), and the sampled pair's prediction of it. AUC: how well "
            "c ranks the drafts that agree above those that do not, over the same anchors "
            "(0.5: no better than chance); AUC of z alone: the confidence head's logit without "
            "the certainty (the reference's head).\n")]
          if spec.kind == "dspark" else []),
        table,
        f"\n_Exported {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC._\n",
    ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
