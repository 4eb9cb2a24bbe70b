"""Real model shapes with random weights (Llama-3.2-1B, Llama-3.1-8B): the decode step against
the memory floor, what verifying 1 + T tokens costs, and speculation at a set acceptance.

The weights are random bfloat16 values made on the device (no download; speed does not depend
on them). Three sections (--sections):

- decode: the engine's compiled generation step (`time_generation_steps`: one token per row,
  back to back, at --position) per batch size, against the floor = bytes a step must read
  (weights; weights + the rows' K/V) / the copy bandwidth measured in this run.
- verify: t(1 + T) / t(1) at batch 1 for T = 1 .. --verify-len and the width of a
  --tree-nodes draft tree's verify (1 + nodes tokens: the causal chain of that width; a
  tree's mask costs nothing more in the step's matmuls).
- spec: plain decoding against EAGLE-3 with a random head of the target's layer shape whose
  drafts are replaced by the plain greedy output, --correct of each step right
  (`specjax.bench.oracle`): the system's efficiency at a known acceptance length, independent
  of training. Steps have fixed shapes, so a step's time does not depend on what it accepts:
  "speedup @ AL" = AL x t(plain step) / t(speculative step) is the speedup the drafting and
  verifying machinery allows at that AL, and "speedup" the one this run got at its measured
  AL (equal when the speculative output stays the plain one, which the last column checks).

`scripts/gpu_check.py` runs this at the 1B and 8B shapes on a GPU; `--shape tiny` is a CPU
smoke run of every section.
"""
from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np
from flax import nnx

from specjax.analysis.timing import (copy_bandwidth, cpu_name, decode_step_time,
                                     decode_weight_bytes, time_generation_steps)
from specjax.bench.oracle import oracle_drafts
from specjax.bench.table import Column, Table
from specjax.llm import LLM
from specjax.models import Llama, ModelConfig
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import EagleConfig

_LLAMA3 = dict(vocab_size=128_256, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
               rope_theta=500_000.0, max_position_embeddings=8192, dtype="bfloat16")
SHAPES = {
    "llama-3.2-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                head_dim=64, tie_word_embeddings=True, **_LLAMA3),
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32,
                                head_dim=128, tie_word_embeddings=False, **_LLAMA3),
    # A CPU smoke run of every section (tests/bench).
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=8,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                        dtype="float32"),
}
SECTIONS = ("decode", "verify", "spec")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b",
                        help="the random model's shape")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections to run: " + ", ".join(SECTIONS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32],
                        help="batch sizes of the decode section")
    parser.add_argument("--position", type=int, default=1024,
                        help="the position (context length) steps are timed at")
    parser.add_argument("--verify-len", type=int, default=8,
                        help="largest T of the verify section's chains")
    parser.add_argument("--tree-nodes", type=int, default=16,
                        help="draft-tree nodes whose verify width (1 + nodes) the verify "
                             "section times (0: none)")
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[2, 4],
                        help="draft lengths of the spec section, each pinned in its own run")
    parser.add_argument("--correct", type=int, default=2,
                        help="drafts right per step in the spec section (AL = this + 1 where "
                             "the draft length allows)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="new tokens per request in the spec section")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="tokens in the spec section's random prompt")


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown or not names:
        raise SystemExit(f"--sections: unknown {unknown or 'empty'}; choose from "
                         f"{', '.join(SECTIONS)}")
    return names


def random_model(config: ModelConfig, seed: int = 0) -> Llama:
    """A Llama of `config`'s shape with random weights, made where JAX computes (the GPU)."""
    return Llama(config, rngs=nnx.Rngs(seed))


def _engine(model: Llama, batch: int, max_len: int, **kw) -> LLM:
    # A pool just large enough (the default takes half the free memory: minutes of zeros at
    # 8B on a 140 GB GPU for nothing).
    blocks = batch * (-(-(max_len + 64) // 16)) + 2
    return LLM(model, max_batch_size=batch, max_model_len=max_len, num_kv_blocks=blocks,
               progress=False, **kw)


def decode_section(model: Llama, args, bandwidth: float) -> None:
    cfg = model.config
    batches = sorted(set(args.batch_sizes))
    llm = _engine(model, max(batches), args.position + 64)
    weights = decode_weight_bytes(llm.engine)
    tab = Table([
        Column("batch", "rows per step", 5, "{:d}"),
        Column("step ms", "the compiled generation step, one token per row, back to back", 8,
               "{:.4g}"),
        Column("floor ms", "weight bytes / copy bandwidth", 8, "{:.4g}"),
        Column("x floor", "step / floor (the issue's figure: 8B <= 1.4, 1B <= 2 at batch 1)", 7),
        Column("+KV floor ms", "(weights + the rows' K/V up to --position) / bandwidth", 12,
               "{:.4g}"),
        Column("x +KV", "step / that floor", 6),
        Column("tok/s", "batch / step", 9, "{:.0f}")])
    print(f"\n-- decode: {weights / 1e9:.2f} GB of weights a step reads, copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s, position {args.position}")
    print(tab.header())
    floor = weights / bandwidth
    for b in batches:
        t = time_generation_steps(llm.engine, b, [1], args.position)[0]
        kv_floor = (weights + b * args.position * cfg.kv_bytes_per_token) / bandwidth
        print(tab.row(b, t * 1e3, floor * 1e3, t / floor, kv_floor * 1e3, t / kv_floor, b / t),
              flush=True)
    print(tab.legend())
    del llm
    gc.collect()


def verify_section(model: Llama, args) -> None:
    widths = list(range(1, args.verify_len + 2))
    if args.tree_nodes:
        widths.append(1 + args.tree_nodes)
    llm = _engine(model, 1, args.position + max(widths) + 64)
    times = time_generation_steps(llm.engine, 1, widths, args.position)
    print(f"\n-- verify: t(1 + T) / t(1), batch 1, position {args.position}; t(1) = "
          f"{times[0] * 1e3:.3f} ms (the issue's figure at 8B: t(5)/t(1) <= 1.05)")
    labels = [f"T={w - 1}" + (" (tree)" if args.tree_nodes and w == 1 + args.tree_nodes
                              else "") for w in widths[1:]]
    print("  " + " ".join(f"{x:>11}" for x in labels))
    print("  " + " ".join(f"{t / times[0]:>11.3f}" for t in times[1:]), flush=True)
    del llm
    gc.collect()


def spec_section(model: Llama, args) -> None:
    cfg = model.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    max_len = args.prompt_len + args.max_tokens + max(args.draft_lens) + 64
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    plain = _engine(model, 1, max_len)
    plain.generate([prompt], greedy(4))  # compile
    out = plain.generate([prompt], greedy(args.max_tokens + max(args.draft_lens) + 2))[0]
    reference = prompt + list(out.token_ids)
    start = time.perf_counter()
    outs = plain.generate([prompt], greedy(args.max_tokens))
    plain_wall = time.perf_counter() - start
    plain_step = decode_step_time(outs)
    del plain
    gc.collect()

    head_cfg = Eagle3HeadConfig.for_target(cfg,
                                           draft_vocab_size=min(32_000, cfg.vocab_size // 2))
    head = Eagle3Head(head_cfg, nnx.Rngs(1))
    tab = Table([
        Column("D", "draft length (pinned)", 2, "{:d}"),
        Column("right", "drafts per step replaced by the plain greedy tokens", 5, "{:d}"),
        Column("AL", "tokens per step measured (prefill's first token left out)", 5),
        Column("step ms", "the speculative engine's decode step (draft + verify + accept)", 8),
        Column("/plain", "that step over plain decoding's step", 6),
        Column("tok/s", "decode tokens per second (after the first token)", 8, "{:.0f}"),
        Column("speedup", "decode tok/s over plain decoding's, at the measured AL", 7),
        Column("@AL", "(right + 1) x plain step / speculative step: the speedup at the set "
               "AL (the issue's figure at 8B, AL 3: >= 2.6)", 6),
        Column("same", "speculative greedy output equals plain greedy output", 4, left=True)])
    plain_rate = 1 / plain_step
    print(f"\n-- spec: plain decoding {plain_step * 1e3:.3f} ms/step "
          f"({plain_rate:.0f} tok/s, {plain_wall:.2f} s for {args.max_tokens} tokens); EAGLE-3 "
          f"head {sum(x.size for x in jax.tree.leaves(nnx.state(head))) / 1e6:.1f}M params, "
          f"draft vocab {head_cfg.draft_vocab_size}")
    print(tab.header())
    with oracle_drafts(reference, args.correct):
        config = EagleConfig(speculative_model=head, max_draft_len=max(args.draft_lens),
                             use_rejection_sampling=False)
        llm = _engine(model, 1, max_len, speculative_config=config)
    for D in args.draft_lens:
        llm.engine.length_policy.pinned = D
        llm.generate([prompt], greedy(8))  # compile this length
        outs = llm.generate([prompt], greedy(args.max_tokens))
        o = outs[0]
        al = (len(o.token_ids) - 1) / max(1, o.stats.decoding_iterations - 1)
        step = decode_step_time(outs)
        rate = al / step
        same = list(o.token_ids) == reference[args.prompt_len:][:len(o.token_ids)]
        print(tab.row(D, args.correct, al, step * 1e3, step / plain_step, rate,
                      rate / plain_rate, (min(args.correct, D) + 1) * plain_step / step,
                      "yes" if same else "NO"), flush=True)
    print(tab.legend())
    del llm
    gc.collect()


def run(args: argparse.Namespace) -> None:
    sections = _sections(args.sections)
    cfg = SHAPES[args.shape]
    dev = jax.devices()[0]
    where = dev.device_kind if dev.platform != "cpu" else f"CPU {cpu_name()}"
    start = time.perf_counter()
    model = random_model(cfg)
    jax.block_until_ready(nnx.state(model))
    print(f"{args.shape}: {cfg.num_params / 1e9:.2f}B params ({cfg.dtype}), random weights "
          f"made in {time.perf_counter() - start:.1f} s on {where}, jax {jax.__version__}")
    bandwidth = copy_bandwidth()
    for name in sections:
        t0 = time.perf_counter()
        if name == "decode":
            decode_section(model, args, bandwidth)
        elif name == "verify":
            verify_section(model, args)
        else:
            spec_section(model, args)
        print(f"   ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
