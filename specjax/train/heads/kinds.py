"""The kinds of head, one class each (`HeadKind`), registered in `spec.KINDS` by name: what each
checks, how it starts, how it drafts in training, its loss and report, its model card.

    eagle3   an EAGLE-3 head (the chain, trained by training-time test)
    mtp      MTP modules: one reused (MTP-Eagle, the chain) or one per draft (the dense chain)
    pard     a PARD draft model (parallel: every draft from one pass)
    dflash   a DFlash drafter (parallel)
    dspark   a DSpark drafter: DFlash's plus a Markov head and a calibrated confidence head
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp

from specjax.models import Llama
from specjax.models.dflash_head import DFlashHead, DFlashHeadConfig
from specjax.models.dspark_head import DSparkHead, DSparkHeadConfig
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.mtp_head import MTPHeads, target_lm_head
from specjax.train.heads.calibration import dspark_report
from specjax.train.heads.loss import dspark_loss, soft_loss
from specjax.train.heads.parallel import dflash_logits, dspark_outputs, pard_logits
from specjax.train.heads.report import chain_acceptance_report
from specjax.train.heads.spec import KINDS, HeadKind, HeadSpec, ModelCard, draft_vocab_maps


def _soft_labels(training: str, spec: HeadSpec) -> str:
    return (f"the target's next-token distribution (soft cross-entropy); {training}; step j "
            f"weighted {spec.step_weight}^(j-1)")


class _Trained(HeadKind):
    """The soft cross-entropy over its drafts and the exact greedy report: every kind's but
    DSpark's."""

    def loss(self, spec, head, target, tokens, valid, target_logits, captured):
        return soft_loss(spec, head, target, tokens, valid, target_logits, captured)

    def report(self, spec, head, target, batches, fit=False):
        return chain_acceptance_report(spec, head, target, batches)


class Eagle3(_Trained):
    name = "eagle3"
    save_dtype = "float32"

    def validate(self, spec):
        layers = spec.capture_layers
        if len(layers) != 3 or len(set(layers)) != 3 or list(layers) != sorted(layers):
            raise ValueError(f"--layers must be 3 distinct ascending layers, got {list(layers)}")
        bad = [x for x in layers if not 0 <= x < spec.num_layers]
        if bad:
            raise ValueError(f"--layers {list(layers)}: {bad} outside the target's "
                             f"{spec.num_layers} layers (0..{spec.num_layers - 1})")

    def label(self, spec):
        return "EAGLE-3"

    def chain(self, spec):
        return True

    def new_head(self, spec, target, rngs, eye, final_norm, counts):
        H = target.config.hidden_size
        config = Eagle3HeadConfig.for_target(target.config, draft_vocab_size=spec.draft_vocab,
                                             aux_hidden_state_layers=spec.capture_layers)
        head = Eagle3Head(config, rngs=rngs)
        head.fc[...] = head.fc[...].at[2 * H:].add(eye)
        if spec.draft_vocab < target.config.vocab_size:
            if counts is None:
                raise ValueError("a reduced draft vocabulary needs the training token counts")
            d2t, t2d = draft_vocab_maps(counts, spec.draft_vocab)
            head.d2t[...] = jnp.asarray(d2t)
            head.t2d[...] = jnp.asarray(t2d)
        ids = head.to_target_ids(jnp.arange(spec.draft_vocab))
        head.lm_head[...] = jnp.take(target_lm_head(target), ids, axis=1).astype(
            head.lm_head.dtype)
        head.norm[...] = final_norm
        return head

    def chain_inputs(self, head, target, captured, depth, rows):
        return head.fuse(captured[:3, :, :rows]), [head] * depth, [head.logits] * depth

    def to_target_ids(self, head, draft_ids):
        return head.to_target_ids(draft_ids)

    def label_logits(self, spec, head, target_logits):
        # A reduced draft vocabulary learns the target's distribution renormalised over it.
        return jnp.take(target_logits, head.to_target_ids(jnp.arange(spec.draft_vocab)),
                        axis=-1)

    def card(self, spec, target_name, out, log):
        return ModelCard(
            what=(f"an EAGLE-3 draft head for `{target_name}`: fc over the target's residual "
                  f"streams after layers {list(spec.capture_layers)} (0-based), one decoder "
                  f"midlayer, a {spec.draft_vocab}-token draft vocabulary"
                  + (" (the whole target vocabulary)" if spec.draft_vocab == log["vocab_size"]
                     else " (the most frequent training tokens; `d2t`/`t2d` map them)")),
            files=("public EAGLE-3 layout (`config.json` + `model.safetensors`, "
                   f"{log['save_dtype']})"),
            use=(f"EagleConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\", "
                 f"eagle3_layers_to_capture={tuple(spec.capture_layers)})"),
            labels=_soft_labels(
                f"training-time test: the head's chain unrolled over {spec.depth} steps as the "
                "engine drafts it (step j attends to the step-1 keys of the accepted prefix "
                "plus the chain's own keys)", spec))


class MTP(_Trained):
    name = "mtp"
    default_depth = 3

    def validate(self, spec):
        if spec.num_modules < 1:
            raise ValueError(f"--num-modules must be >= 1, got {spec.num_modules}")
        if spec.num_modules > 1 and spec.depth > spec.num_modules:
            raise ValueError(f"--depth {spec.depth} exceeds --num-modules {spec.num_modules}: "
                             "vanilla MTP drafts one token per module")

    def label(self, spec):
        return "MTP-Eagle" if spec.num_modules == 1 else f"MTP ({spec.num_modules} modules)"

    def chain(self, spec):
        return spec.num_modules == 1

    def new_head(self, spec, target, rngs, eye, final_norm, counts):
        H = target.config.hidden_size
        heads = MTPHeads(target.config, spec.num_modules, rngs=rngs)
        for module in heads.modules:
            module.final_norm[...] = jnp.array(final_norm, copy=True)
            module.eh_proj[...] = module.eh_proj[...].at[H:].add(eye)
        return heads

    def chain_inputs(self, head, target, captured, depth, rows):
        modules = [head.module_for_step(j) for j in range(depth)]
        lm_head = target_lm_head(target)
        return (captured[-1, :, :rows], modules,
                [partial(m.logits, lm_head=lm_head) for m in modules])

    def card(self, spec, target_name, out, log):
        modules = ("an MTP-Eagle module (one module reused for every draft step)"
                   if spec.num_modules == 1
                   else f"{spec.num_modules} MTP modules (module k drafts token k)")
        return ModelCard(
            what=(f"{modules} for `{target_name}`, each a target-style decoder layer on "
                  "eh_proj(concat(enorm(embedding), hnorm(hidden))); the LM head is the "
                  "target's"),
            files=(f"`config.json` + `model.safetensors` in the specjax MTP layout "
                   f"(`specjax.models.mtp_checkpoint`, {log['save_dtype']})"),
            use=(f"MTPConfig(max_draft_len={spec.depth}, num_nextn_predict_layers="
                 f"{spec.num_modules}, use_mtp_vanilla={spec.num_modules > 1}, "
                 f"speculative_model=\"{out}\")"),
            labels=_soft_labels("training-time test over the reused module's chain"
                                if spec.chain else "the dense MTP chain (module k reads module "
                                "k-1's hidden state)", spec))


class _Parallel(_Trained):
    """Every draft of a block from one pass, started from the target's first layers."""

    parallel = True

    def validate(self, spec):
        if not 1 <= spec.drafter_layers:
            raise ValueError(f"--drafter-layers must be >= 1, got {spec.drafter_layers}")
        self._check_drafter_layers(spec)
        bad = [x for x in spec.capture_layers if not 0 <= x < spec.num_layers]
        if bad or list(spec.capture_layers) != sorted(set(spec.capture_layers)):
            raise ValueError(f"--layers {list(spec.capture_layers)}: distinct ascending layers "
                             f"of the target's {spec.num_layers} (0..{spec.num_layers - 1})")

    def _check_drafter_layers(self, spec):
        """What this kind adds to the checks of its drafter layers."""

    def _start_from_target(self, target: Llama, layers, n: int) -> None:
        """The drafter's `n` layers start as the target's first ones."""
        for name, param in target.layers.items():
            layers[name][...] = jnp.array(param[...][:n], copy=True)


class PARD(_Parallel):
    name = "pard"

    def _check_drafter_layers(self, spec):
        if spec.drafter_layers > spec.num_layers:
            raise ValueError(f"--drafter-layers {spec.drafter_layers} exceeds the target's "
                             f"{spec.num_layers} layers (PARD starts from the first ones)")

    def label(self, spec):
        return "PARD"

    def new_head(self, spec, target, rngs, eye, final_norm, counts):
        """The target's embeddings (plus a mask row, the mean embedding), its first
        `drafter_layers` layers and final norm."""
        cfg = target.config
        draft = Llama(cfg.replace(vocab_size=cfg.vocab_size + 1, num_layers=spec.drafter_layers,
                                  sliding_windows=None), rngs=rngs)
        embed = target.embed[...]
        draft.embed[...] = jnp.concatenate([embed, embed.mean(0, keepdims=True)]).astype(
            draft.embed.dtype)
        if not cfg.tie_word_embeddings:
            lm = target.lm_head[...]
            draft.lm_head[...] = jnp.concatenate([lm, jnp.zeros_like(lm[:, :1])], axis=1)
        self._start_from_target(target, draft.layers, spec.drafter_layers)
        draft.final_norm[...] = final_norm
        return draft

    def block_logits(self, spec, head, target, captured, tokens):
        V = target.config.vocab_size
        return pard_logits(head, tokens, spec.depth, V, V)

    def card(self, spec, target_name, out, log):
        return ModelCard(
            what=(f"a PARD draft model for `{target_name}` (any target of its tokenizer): a "
                  f"{spec.drafter_layers}-layer causal LM shaped like the target's layers, its "
                  "vocabulary plus one mask token (`pard_token` in config.json), started from "
                  f"the target's embeddings and first {spec.drafter_layers} layers"),
            files=(f"a Hugging Face Llama folder (`config.json` with `pard_token`, "
                   f"`model.safetensors` in {log['save_dtype']}, `tokenizer.json`)"),
            use=f"PARDConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")",
            labels=_soft_labels(
                f"the PARD objective: at every anchor the prefix and {spec.depth - 1} mask "
                "tokens, row k after the prefix predicting the token k ahead", spec))


DFLASH_TRAINING = ("every position an anchor: the block [token, mask x {depth}] sees the "
                   "context before it and itself (bidirectionally), block row k labelled with "
                   "the target's distribution k - 1 rows on")


class DFlash(_Parallel):
    name = "dflash"

    def validate(self, spec):
        super().validate(spec)
        if not spec.capture_layers:
            raise ValueError(f"{spec.label} needs at least one target layer (--layers)")

    def label(self, spec):
        return "DFlash"

    def _drafter(self, spec, config: DFlashHeadConfig, rngs):
        return DFlashHead(config, rngs=rngs)

    def new_head(self, spec, target, rngs, eye, final_norm, counts):
        """The target's first `drafter_layers` layers and final norm; fc passes the first
        captured layer through."""
        cfg = target.config
        config = DFlashHeadConfig.for_target(cfg, spec.drafter_layers, spec.capture_layers,
                                             spec.depth)
        draft = self._drafter(spec, config, rngs)
        draft.fc[...] = draft.fc[...].at[:cfg.hidden_size].add(eye)
        draft.body.embed[...] = target.embed[...].mean(0, keepdims=True)
        self._start_from_target(target, draft.body.layers, spec.drafter_layers)
        draft.body.final_norm[...] = final_norm
        return draft

    def block_logits(self, spec, head, target, captured, tokens):
        return dflash_logits(head, target, captured, tokens, spec.depth)

    def card(self, spec, target_name, out, log):
        return ModelCard(
            what=(f"a DFlash drafter for `{target_name}`: {spec.drafter_layers} decoder layers "
                  f"shaped like the target's (started from its first ones), fc over the "
                  f"target's residual streams after layers {list(spec.capture_layers)} "
                  "(0-based) injected as keys and values into every layer; the embeddings and "
                  "LM head are the target's"),
            files=(f"`config.json` + `model.safetensors` in the layout of "
                   f"`specjax.models.dflash_checkpoint` ({log['save_dtype']})"),
            use=f"DFlashConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")",
            labels=_soft_labels(DFLASH_TRAINING.format(depth=spec.depth), spec))


class DSpark(DFlash):
    """DFlash's body, initialised the same way (same draws), plus its own heads as
    `DSparkHead` makes them (Markov out and confidence zero: a fresh head drafts as its DFlash
    body; calibration the identity). Trained on DeepSpec's objective; its confidence is
    calibrated on the final report's windows."""

    name = "dspark"

    def validate(self, spec):
        super().validate(spec)
        if spec.markov_rank < 1:
            raise ValueError(f"--markov-rank must be >= 1, got {spec.markov_rank}")

    def label(self, spec):
        return "DSpark"

    def _drafter(self, spec, config, rngs):
        return DSparkHead(DSparkHeadConfig.of(config, spec.markov_rank), rngs=rngs)

    def block_logits(self, spec, head, target, captured, tokens):
        return dspark_outputs(head, target, captured, tokens, spec.depth)[0]

    def loss(self, spec, head, target, tokens, valid, target_logits, captured):
        return dspark_loss(spec, head, target, tokens, valid, target_logits, captured)

    def report(self, spec, head, target, batches, fit=False):
        # Sequential drafts through the Markov head, and the confidence against them.
        return dspark_report(spec, head, target, batches, fit=fit)

    def card(self, spec, target_name, out, log):
        training = (DFLASH_TRAINING.format(depth=spec.depth) + "; the Markov head reads the "
                    "TRUE previous token (one pass, teacher-forced)")
        return ModelCard(
            what=(f"a DSpark drafter for `{target_name}`: a DFlash drafter "
                  f"({spec.drafter_layers} decoder layers shaped like the target's, started "
                  f"from its first ones, fc over the target's residual streams after layers "
                  f"{list(spec.capture_layers)} (0-based) injected as keys and values into "
                  f"every layer; the embeddings and LM head are the target's) plus a rank-"
                  f"{spec.markov_rank} Markov head (each draft's logits get a term of the "
                  "token before it, so the block is drafted one token at a time after the one "
                  "pass) and a confidence head with a per-position logistic calibration of its "
                  "logit and the drafter's certainty (greedy and sampled)"),
            files=(f"`config.json` + `model.safetensors` in the layout of "
                   f"`specjax.models.dflash_checkpoint`, architecture SpecjaxDSparkDrafter "
                   f"({log['save_dtype']}; the confidence head and its calibration float32)"),
            use=f"DSparkConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\")",
            labels=(f"the target's next-token distribution; {training}; DeepSpec's loss: "
                    "draft k weighted exp(-(k-1)/4) x [0.1 soft cross-entropy + 0.9 L1 between "
                    "the draft's and the target's distributions + BCE(sigmoid(z_k), 1 - TV)] "
                    "(TV = half the L1, a stop-gradient label)"),
            notes=(
                "DSpark drafts the block one token at a time (x_k = argmax(base_k + "
                "markov(x_{k-1})), x_0 the anchor), as the engine does; the confidence z_k "
                "reads the drafted x_{k-1}. Predicted c: the mean calibrated confidence (greedy "
                "rule) over the anchors that reach depth k, against the measured conditional "
                "agreement; the per-position maps sigmoid(scale z + bias + gain u) (u: the "
                "drafter's largest log-probability) were fitted on these same anchors "
                "(held-out |diff|: a two-fold cross-fit). 1 - TV: the mean acceptance "
                "probability of rejection sampling at temperature 1 (the sampled rule's label), "
                "and the sampled pair's prediction of it. AUC: how well c ranks the drafts that "
                "agree above those that do not, over the same anchors (0.5: no better than "
                "chance); AUC of z alone: the confidence head's logit without the certainty "
                "(the reference's head).\n"))


KINDS.update({kind.name: kind for kind in (Eagle3(), MTP(), PARD(), DFlash(), DSpark())})
