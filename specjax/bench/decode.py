"""Plain decoding: specjax vs Hugging Face transformers `generate` on the same weights.

Both run in one command, one after the other, on identical prompts; each is warmed up first.
transformers runs in a child process so that neither framework's idle worker threads (OpenMP
spin-waits, XLA's pool) steal the 2 cores from the other while it is being timed.
Host overhead is the part of an engine decode step not spent in the compiled step itself. The
engine's decode step time is the requests' time after their first token (prefill and setup
excluded) over their decode steps; the compiled step is the same generation step called back to
back at the decode steps' mean position (prompt + max_tokens / 2). Both are the fastest of
--repeats runs; the overhead is their difference, in milliseconds and as a share of the engine
step, unclamped: a negative value means the engine's steps ran faster than the separately
timed compiled step (machine noise, or the overlap scheduler hiding host work behind the
device's).
"""
from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from specjax.bench.timing import decode_step_time, time_generation_step
from specjax.llm import LLM
from specjax.models import Llama, ModelConfig, save_hf_checkpoint
from specjax.models.registry import resolve_model_path
from specjax.sampling_params import SamplingParams

# A Llama-shaped model of about 25M parameters (random weights: speed does not depend on them).
RANDOM_25M = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random-25m",
                        help="'random-25m' (default), 'bundled' or a checkpoint folder")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")


_HF = {}


def _hf_load(folder: str) -> str:
    """Child process initializer: load the transformers model once."""
    import torch
    import transformers
    _HF["model"] = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def _hf_generate(prompts: list[list[int]], max_tokens: int):
    """Child process: one timed greedy `generate` (warmed up on first use), and its tokens."""
    import torch
    ids = torch.tensor(prompts)
    gen = lambda: _HF["model"].generate(ids, max_new_tokens=max_tokens,
                                        min_new_tokens=max_tokens, do_sample=False,
                                        pad_token_id=0)
    with torch.no_grad():
        if _HF.get("warm") != ids.shape:
            gen()
            _HF["warm"] = ids.shape
        start = time.perf_counter()
        tokens = gen()
        elapsed = time.perf_counter() - start
    return elapsed, tokens[:, len(prompts[0]):].tolist()


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random-25m":
            folder = Path(tmp) / "random-25m"
            save_hf_checkpoint(Llama(RANDOM_25M, rngs=nnx.Rngs(0)), folder)
        else:
            folder = resolve_model_path(args.model)
        llm = LLM(str(folder), dtype="float32", max_batch_size=max(args.batch_sizes),
                  max_model_len=min(1024, args.prompt_len + args.max_tokens + 16))
        cfg = llm.model.config
        print(f"model: {args.model} ({cfg.num_params / 1e6:.1f}M parameters, {cfg.num_layers} "
              f"layers, d={cfg.hidden_size}), float32, {args.max_tokens} new tokens, "
              f"prompt {args.prompt_len} tokens, jax {jax.__version__} on {jax.devices()[0].platform}")
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            if not args.no_hf:
                versions = pool.apply(_hf_load, (str(folder),))
                print(f"  (transformers side: {versions}; the best of {args.repeats} runs "
                      "each, alternating)")
            print(f"\n{'batch':>5} {'specjax tok/s':>14} {'HF tok/s':>10} {'ratio':>7} "
                  f"{'step ms':>8} {'compiled ms':>12} {'host ms':>8} {'host %':>7} "
                  f"{'same tokens':>12}")
            for bsz in args.batch_sizes:
                prompts = rng.integers(0, cfg.vocab_size, size=(bsz, args.prompt_len)).tolist()
                llm.generate(prompts, params)  # warm
                t_sj = t_hf = step = compiled = float("inf")
                same = 0
                # Alternate the frameworks so that machine noise hits both alike; keep the best.
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    t_sj = min(t_sj, time.perf_counter() - start)
                    step = min(step, decode_step_time(outs))
                    compiled = min(compiled, time_generation_step(
                        llm.engine, bsz, 1, args.prompt_len + args.max_tokens // 2, iters=30))
                    if not args.no_hf:
                        time.sleep(0.3)  # let the other side's idle threads go to sleep
                        hf_time, ref = pool.apply(_hf_generate, (prompts, args.max_tokens))
                        t_hf = min(t_hf, hf_time)
                        same += sum(o.token_ids == r for o, r in zip(outs, ref))
                        time.sleep(0.3)
                sj_tps = bsz * args.max_tokens / t_sj
                host = step - compiled
                hf_tps = float("nan") if args.no_hf else bsz * args.max_tokens / t_hf
                same = "-" if args.no_hf else f"{same}/{bsz * args.repeats}"
                print(f"{bsz:>5} {sj_tps:>14.1f} {hf_tps:>10.1f} {sj_tps / hf_tps:>6.2f}x "
                      f"{step * 1e3:>8.2f} {compiled * 1e3:>12.2f} {host * 1e3:>8.2f} "
                      f"{host / step:>7.1%} {same:>12}", flush=True)
            print(f"\ntok/s = new tokens / wall time of the whole generate call (prefill "
                  f"included), the fastest of {args.repeats} runs; step ms = the engine's time "
                  "per decode step after each request's first token (prefill excluded); "
                  "compiled ms = the compiled generation step called back to back at position "
                  f"{args.prompt_len + args.max_tokens // 2} (prompt + max_tokens / 2); host = "
                  "step - compiled, per step and as a share of the step, unclamped (negative: "
                  "the engine's steps beat the compiled step timed alone); same tokens = "
                  "sequences equal to transformers' over every run.")
