"""Plain decoding: specjax vs Hugging Face transformers `generate` on the same weights.

What a user gets: the model is saved as a Hugging Face checkpoint and loaded with
`specjax.LLM(folder)` at its defaults (max_model_len = the model's 2048 positions), and
both sides are timed on whole `generate` calls over identical prompts, each warmed up
first. transformers runs in a child process so that neither framework's idle worker threads
(OpenMP spin-waits, XLA's pool) steal the cores from the other while it is being timed; the
two alternate, and each keeps its fastest of --repeats runs.

Per batch size: tokens/s end to end (prefill included) and decode-only, the same for both
frameworks: B x (N - 1) / (t_N - t_1), where t_N is a generate call for N new tokens and t_1
one for a single token (prefill + first token). The engine's step time (its requests' time
after their first token over their decode steps), the compiled step alone (called back to
back at the decode's mean position), and the host overhead = their difference, unclamped
(negative: the overlap scheduler hid host work behind the device, or noise).

Then the floor: the batch-1 step against the weight bytes a step must read over the copy
bandwidth measured in this run; and verification cost, t(D+1)/t(1) for D = 1..8 at batch 1
and 8, the ratio that caps every speculative speedup.
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

from specjax.bench.timing import (copy_bandwidth, decode_step_time, decode_weight_bytes,
                                  time_generation_steps)
from specjax.llm import LLM
from specjax.models import Llama, ModelConfig, save_hf_checkpoint
from specjax.models.registry import resolve_model_path
from specjax.sampling_params import SamplingParams

# A Llama shape of 27.8M parameters (random weights: speed does not depend on them).
RANDOM_28M = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random-28m",
                        help="'random-28m' (default), 'bundled' or a checkpoint folder")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the model's, as LLM(folder))")
    parser.add_argument("--verify-len", type=int, default=8,
                        help="largest D for the t(D+1)/t(1) table (0: skip it)")
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
        if _HF.get("warm") != (ids.shape, max_tokens):
            gen()
            _HF["warm"] = (ids.shape, max_tokens)
        start = time.perf_counter()
        tokens = gen()
        elapsed = time.perf_counter() - start
    return elapsed, tokens[:, len(prompts[0]):].tolist()


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random-28m":
            folder = Path(tmp) / "random-28m"
            save_hf_checkpoint(Llama(RANDOM_28M, rngs=nnx.Rngs(0)), folder)
        else:
            folder = resolve_model_path(args.model)
        start = time.perf_counter()
        llm = LLM(str(folder), dtype="float32", max_batch_size=max(args.batch_sizes),
                  max_model_len=args.max_model_len, progress=False)
        setup = time.perf_counter() - start
        cfg = llm.model.config
        N, P = args.max_tokens, args.prompt_len
        print(f"model: {args.model} ({cfg.num_params / 1e6:.1f}M parameters, {cfg.num_layers} "
              f"layers, d={cfg.hidden_size}), float32, prompt {P} tokens, {N} new tokens, "
              f"max_model_len {llm.engine.max_len}; jax {jax.__version__} on "
              f"{jax.devices()[0].platform}; LLM(folder) load + warm-up {setup:.1f} s")
        rng = np.random.default_rng(0)
        full = SamplingParams(max_tokens=N, ignore_eos=True)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        ctx = multiprocessing.get_context("spawn")
        position = P + N // 2
        rows = []
        with ctx.Pool(1) as pool:
            if not args.no_hf:
                versions = pool.apply(_hf_load, (str(folder),))
                print(f"  (transformers side: {versions}; alternating, the best of "
                      f"{args.repeats} runs each)")
            print(f"\n{'batch':>5} {'specjax tok/s':>13} {'HF tok/s':>9} {'ratio':>6} "
                  f"{'sj decode':>10} {'HF decode':>10} {'ratio':>6} {'step ms':>8} "
                  f"{'compiled':>9} {'host ms':>8} {'host %':>7} {'same':>6}")
            for bsz in args.batch_sizes:
                prompts = rng.integers(0, cfg.vocab_size, size=(bsz, P)).tolist()
                llm.generate(prompts, full)  # warm (every shape is compiled already)
                sj = {"N": np.inf, "1": np.inf, "step": np.inf, "compiled": np.inf}
                hf = {"N": np.inf, "1": np.inf}
                same = 0
                # Alternate the frameworks so that machine noise hits both alike.
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    outs = llm.generate(prompts, full)
                    sj["N"] = min(sj["N"], time.perf_counter() - start)
                    start = time.perf_counter()
                    llm.generate(prompts, one)
                    sj["1"] = min(sj["1"], time.perf_counter() - start)
                    sj["step"] = min(sj["step"], decode_step_time(outs))
                    sj["compiled"] = min(sj["compiled"], time_generation_steps(
                        llm.engine, bsz, [1], position, iters=20, rounds=1)[0])
                    if not args.no_hf:
                        time.sleep(0.3)  # let the other side's idle threads go to sleep
                        t, ref = pool.apply(_hf_generate, (prompts, N))
                        hf["N"] = min(hf["N"], t)
                        hf["1"] = min(hf["1"], pool.apply(_hf_generate, (prompts, 1))[0])
                        same += sum(o.token_ids == r for o, r in zip(outs, ref))
                        time.sleep(0.3)
                e2e = lambda d: bsz * N / d["N"]
                decode = lambda d: bsz * (N - 1) / (d["N"] - d["1"])
                host = sj["step"] - sj["compiled"]
                hf_e2e = np.nan if args.no_hf else e2e(hf)
                hf_dec = np.nan if args.no_hf else decode(hf)
                same_txt = "-" if args.no_hf else f"{same}/{bsz * args.repeats}"
                print(f"{bsz:>5} {e2e(sj):>13.1f} {hf_e2e:>9.1f} {e2e(sj) / hf_e2e:>5.2f}x "
                      f"{decode(sj):>10.1f} {hf_dec:>10.1f} {decode(sj) / hf_dec:>5.2f}x "
                      f"{sj['step'] * 1e3:>8.2f} {sj['compiled'] * 1e3:>9.2f} "
                      f"{host * 1e3:>8.2f} {host / sj['step']:>7.1%} {same_txt:>6}", flush=True)
                rows.append((bsz, sj))
        print(f"\ntok/s = B x {N} new tokens / the whole generate call (prefill included); "
              f"decode = B x {N - 1} / (t_{N} - t_1), t_1 = a generate call for one token, the "
              f"same for both; step ms = the engine's time per decode step (its requests' time "
              f"after their first token / their steps); compiled = the compiled generation "
              f"step alone, back to back at position {position}; host = step - compiled "
              f"(unclamped); same = sequences equal to transformers' over every run.")

        weights = decode_weight_bytes(llm.engine)
        bandwidth = copy_bandwidth()
        floor = weights / bandwidth
        step1 = next((sj for b, sj in rows if b == 1), None)
        if step1 is not None:
            print(f"\nroofline (batch 1): a decode step reads {weights / 1e6:.1f} MB of weights; "
                  f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write, measured now) -> "
                  f"floor {floor * 1e3:.2f} ms; compiled step {step1['compiled'] * 1e3:.2f} ms "
                  f"= {step1['compiled'] / floor:.2f}x the floor, engine step "
                  f"{step1['step'] * 1e3:.2f} ms = {step1['step'] / floor:.2f}x")

        if args.verify_len:
            widths = list(range(1, args.verify_len + 2))
            print(f"\nverification cost t(D+1)/t(1), compiled step at position {position}, "
                  "the widths alternating (best of 3 rounds each):")
            print(f"{'batch':>5} {'t(1) ms':>8} " + " ".join(f"{f'D={w - 1}':>6}"
                                                             for w in widths[1:]))
            for bsz in sorted({1, 8} & set(args.batch_sizes) or {1}):
                t = time_generation_steps(llm.engine, bsz, widths, position)
                print(f"{bsz:>5} {t[0] * 1e3:>8.2f} " + " ".join(f"{x / t[0]:>6.2f}"
                                                                  for x in t[1:]), flush=True)
