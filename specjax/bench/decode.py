"""Plain decoding: specjax vs Hugging Face transformers `generate` on the same weights.

What a user gets: the model (--model: the bundled checkpoint by default; `random-28m` saves a
random 27.8M-parameter Llama as a Hugging Face checkpoint, the README's figures) is loaded with
`specjax.LLM(folder)` at its defaults (max_model_len = the model's positions), and both sides
are timed on whole `generate` calls over identical random prompts, each warmed up first.
transformers runs in a child process so that neither framework's idle worker threads (OpenMP
spin-waits, XLA's pool) steal the cores from the other while it is being timed; the two
alternate, and each keeps its fastest of --repeats runs. transformers needs the `bench` extra
(torch, transformers): pip install -e ".[bench]"; --no-hf times specjax alone.

Per batch size: tokens/s end to end (prefill included) and decode-only, the same for both
frameworks: B x (N - 1) / (t_N - t_1), where t_N is a generate call for N new tokens and t_1
one for a single token (prefill + first token). The engine's step time (its requests' time
after their first token over their decode steps), the compiled step alone (called back to
back at the decode's mean position), and the host overhead = their difference, unclamped
(negative: the overlap scheduler hid host work behind the device, or noise).

llama.cpp (`--llama-cpp PYTHON`, an interpreter with llama-cpp-python: never a specjax
dependency) is timed the same way at batch 1, on a float32 GGUF written from the very weights
the engine runs, with as many threads as the machine has cores. After the table, parity on
held-out prompts (through the model's chat template when it has one): the max |logit
difference| from transformers and how many greedy continuations equal its own.

Then the floor: the batch-1 step against the weight bytes a step must read over the copy
bandwidth measured in this run; and verification cost, t(D+1)/t(1) for D = 1..--verify-len
at batch 1 and 8, the ratio that caps every speculative speedup. A legend under the table says
what each column means.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from specjax.bench.llamacpp import float32_gguf, llama_cpp_child
from specjax.bench.table import Column, Table
from specjax.analysis.timing import (copy_bandwidth, cpu_name, decode_step_time,
                                     decode_weight_bytes, time_generation_steps)
from specjax.cli import require
from specjax.llm import LLM
from specjax.models import Llama, ModelConfig, save_hf_checkpoint
from specjax.models.gguf_checkpoint import gguf_types, is_gguf
from specjax.models.linear import ACTIVATION_BITS
from specjax.models.linear import is_quantized
from specjax.models.registry import installed_help, resolve_model_path
from specjax.sampling_params import SamplingParams

# A Llama shape of 27.8M parameters (random weights: speed does not depend on them).
RANDOM_28M = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False)
RANDOM_NAME = "random-28m"  # --model: RANDOM_28M with seed-0 weights, saved for both frameworks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled",
                        help="'bundled' (the checkpoint specjax.LLM(\"bundled\") loads), "
                             f"{installed_help()}, '{RANDOM_NAME}' (a random 27.8M-parameter Llama "
                             "saved as a Hugging Face checkpoint: the README's figures), a "
                             "Hugging Face checkpoint folder or a GGUF file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32],
                        help="batch sizes to time, one table row each")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="new tokens per sequence (N)")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="tokens per random prompt (P)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per framework, alternating; the best is kept")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the model's "
                             "max_position_embeddings, as LLM(folder))")
    parser.add_argument("--verify-len", type=int, default=8,
                        help="largest D for the t(D+1)/t(1) table (0: skip it)")
    parser.add_argument("--no-hf", action="store_true",
                        help="skip transformers: time specjax alone (no torch needed)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="load the model in this dtype (a quantized GGUF dequantized to "
                             "it); default: as LLM(model) loads it, a GGUF's quantized "
                             "weights kept quantized")
    parser.add_argument("--quantize", choices=("q8_0", "q4_0"), default=None,
                        help="quantize a float checkpoint's weights at load (LLM(quantize=))")
    parser.add_argument("--activation-bits", type=int, choices=ACTIVATION_BITS, default=16,
                        help="the bits x is rounded to against quantized weights "
                             "(LLM(activation_bits=)): 8 as llama.cpp's Q8 activations")
    parser.add_argument("--llama-cpp", metavar="PYTHON", default=None,
                        help="an interpreter with llama-cpp-python installed (its own "
                             "virtualenv: specjax never installs it): time llama.cpp at batch "
                             "1 on the same weights -- the GGUF file itself when the engine "
                             "keeps it quantized, else a float32 GGUF written from the "
                             "engine's weights (GGUF models only: the file's tokenizer goes "
                             "with them)")
    parser.add_argument("--parity-prompts", type=int, default=16,
                        help="held-out prompts (chat-templated where the model has a "
                             "template) for the parity lines against transformers: max "
                             "|logit difference| and greedy tokens equal over 64 (0: skip)")


def table(N: int, P: int, repeats: int, position: int, roofline: bool = True,
          verify: bool = True) -> Table:
    """The per-batch-size table and its legend (N new tokens, P-token prompts, the fastest of
    `repeats` runs, the compiled step timed at `position`); `roofline`, `verify`: the legend
    explains the roofline line and the t(D+1)/t(1) table printed after it."""
    best = f"the fastest of {repeats} runs" if repeats > 1 else "one run"
    return Table([
        Column("batch", f"B, sequences per generate call, each a random {P}-token prompt",
               5, "{}"),
        Column("specjax tok/s", f"B x {N} new tokens / the whole specjax generate call "
               f"(prefill included), {best}", 13, "{:.1f}"),
        Column("HF tok/s", "the same for transformers' generate on the same weights (greedy, "
               "in a child process)", 9, "{:.1f}"),
        Column("ratio", "specjax tok/s / HF tok/s (above 1: specjax is faster)", 6, "{:.2f}x"),
        Column("lcpp tok/s", "the same for llama.cpp (--llama-cpp; batch 1: greedy from a fresh "
               "context, float32 GGUF of the same weights, as many threads as cores)", 10,
               "{:.1f}"),
        Column("vs lcpp", "specjax tok/s / llama.cpp tok/s", 7, "{:.2f}x"),
        Column("sj decode", f"decode-only tokens/s: B x {N - 1} / (t_{N} - t_1), t_{N} and t_1 "
               f"the fastest generate calls for {N} and for 1 new token (the prompt's prefill "
               "and first token cancel out)", 10, "{:.1f}"),
        Column("HF decode", "the same for transformers", 10, "{:.1f}"),
        Column("decode ratio", "sj decode / HF decode: the ratio with the prefill left out",
               12, "{:.2f}x"),
        Column("lcpp decode", "decode-only tokens/s for llama.cpp, as sj decode", 11, "{:.1f}"),
        Column("step ms", "the engine's time per decode step: its requests' time after their "
               "first token / their decode steps", 8),
        Column("compiled ms", f"the compiled generation step alone, called back to back at "
               f"position {position} (prompt + half the new tokens)", 11),
        Column("host ms", "step ms - compiled ms, unclamped: the host loop's cost per step "
               "(negative: the overlap scheduler hid host work behind the device, or noise)", 8),
        Column("host %", "host ms / step ms", 7, "{:.1%}"),
        Column("same", "sequences equal to transformers' token for token, over every run", 6),
    ], notes=[note for note, shown in zip([
        ("roofline", "the batch-1 step against its floor: the weight bytes a decode step must "
         "read / the memory copy bandwidth measured in this run (read + write); 'Nx the floor' "
         "is how many times the floor a step takes"),
        ("t(D+1)/t(1)", f"the compiled step for D+1 query tokens (the newest token + D drafts "
         f"to verify) over that for 1, both at position {position} with the same block "
         "tables: what checking D drafts costs. A speculative method's decode speedup is "
         "tokens/step x t(1)/t(D+1) x its efficiency (python -m specjax.bench spec)"),
    ], [roofline, verify]) if shown])


_HF = {}


def _hf_load(folder: str) -> str:
    """Child process initializer: load the transformers model once."""
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its bar would print at the child's exit
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF loader's own bar ignores the switch above
    path = Path(folder)
    where = ((str(path.parent), {"gguf_file": path.name}) if path.is_file()
             else (folder, {}))
    _HF["model"] = transformers.AutoModelForCausalLM.from_pretrained(
        where[0], dtype=torch.float32, **where[1]).eval()
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def _hf_generate(prompts: list[list[int]], max_tokens: int):
    """Child process: one timed greedy `generate` (warmed up on first use), and its tokens."""
    import torch
    ids = torch.tensor(prompts)
    # Equal-length prompts, no padding: every position is attended to (the bundled model's pad
    # and EOS ids coincide, from which transformers could not infer that itself).
    gen = lambda: _HF["model"].generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                        do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if _HF.get("warm") != (ids.shape, max_tokens):
            gen()
            _HF["warm"] = (ids.shape, max_tokens)
        start = time.perf_counter()
        tokens = gen()
        elapsed = time.perf_counter() - start
    return elapsed, tokens[:, len(prompts[0]):].tolist()


def _hf_parity(prompt: list[int], max_tokens: int, stop: list[int]):
    """Child process: transformers' logits over `prompt` and its greedy continuation."""
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = _HF["model"](ids).logits[0].numpy()
        tokens = _HF["model"].generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=stop or None,
                                       pad_token_id=stop[0] if stop else 0)
    return logits, tokens[0, len(prompt):].tolist()


@contextlib.contextmanager
def _hf_child(folder: Path | None):
    """The transformers side: one spawned worker with the model loaded (None: no worker).

    The worker is closed and joined, not terminated: `Pool.__exit__` terminates its workers
    (SIGTERM), so their exit finalizers never run, and the multiprocessing lock tqdm creates in
    the worker (transformers' weight-loading bar) stayed registered with the resource tracker,
    which warned at exit about "leaked semaphore objects"."""
    if folder is None:
        yield None
        return
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        versions = pool.apply(_hf_load, (str(folder),))
        yield pool, versions
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


# Held-out prompts for the parity lines: no bench or training set holds them.
PARITY_PROMPTS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.", "Give me a synonym for 'happy'.",
    "What is 12 times 7?", "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.", "Who wrote Romeo and Juliet?",
    "List the planets of the solar system.", "What does a thermometer measure?",
    "Suggest a name for a pet turtle.", "Why is the sky blue?",
    "Describe a cat in five words.", "What is the boiling point of water in Celsius?",
]


def _parity(llm: LLM, pool, count: int, tokens: int = 64) -> None:
    """Max |logit difference| (the model's dense forward vs transformers) and greedy
    continuations equal token for token, on `count` held-out prompts."""
    import jax.numpy as jnp
    from specjax.chat import ChatTemplate
    if llm.tokenizer is None or count <= 0:
        return
    template = ChatTemplate.from_tokenizer(llm.tokenizer)
    prompts = [template.prompt_ids(llm.tokenizer, [{"role": "user", "content": q}])
               if template.source else llm.tokenizer.encode(q, add_bos=None)
               for q in (PARITY_PROMPTS * (1 + count // len(PARITY_PROMPTS)))[:count]]
    stop = list(llm.engine.eos_token_ids)
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0))
    worst, same, lengths = 0.0, 0, []
    for prompt, out in zip(prompts, outs):
        logits, ref = pool.apply(_hf_parity, (prompt, tokens, stop))
        ours = np.asarray(llm.model.forward(jnp.asarray([prompt], jnp.int32))[0][0])
        worst = max(worst, float(np.abs(ours - logits).max()))
        same += out.token_ids == ref
        lengths.append(len(ref))
    print(f"\nparity with transformers on {count} held-out prompts"
          f"{' (chat template)' if template.source else ''}: max |logit difference| "
          f"{worst:.2e} (float32), greedy continuations equal {same}/{count} "
          f"(up to {tokens} tokens, {np.mean(lengths):.0f} on average)")


def _check(args: argparse.Namespace) -> None:
    """What can fail without loading anything: the model's name and the optional packages."""
    if args.model != RANDOM_NAME:
        try:
            resolve_model_path(args.model)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"--model: {e}") from None
    if not args.no_hf:
        try:
            require("python -m specjax.bench decode", "torch", "transformers")
        except SystemExit as e:
            raise SystemExit(f"{e}; or pass --no-hf to time specjax alone") from None


def run(args: argparse.Namespace) -> None:
    _check(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == RANDOM_NAME:
            folder = Path(tmp) / RANDOM_NAME
            save_hf_checkpoint(Llama(RANDOM_28M, rngs=nnx.Rngs(0)), folder)
        else:
            folder = resolve_model_path(args.model)
        start = time.perf_counter()
        llm = LLM(str(folder), dtype=args.dtype, quantize=args.quantize,
                  activation_bits=args.activation_bits,
                  max_batch_size=max(args.batch_sizes),
                  max_model_len=args.max_model_len, progress=False, warmup=True)
        setup = time.perf_counter() - start
        cfg = llm.model.config
        N, P = args.max_tokens, args.prompt_len
        quantized = is_quantized(llm.model)
        weights = cfg.dtype
        if quantized:
            weights = (f"{', '.join(gguf_types(folder))} kept quantized" if is_gguf(folder)
                       else f"quantized to {args.quantize}")
        print(f"model: {args.model} ({cfg.num_params / 1e6:.1f}M parameters, {cfg.num_layers} "
              f"layers, d={cfg.hidden_size}), {weights}, prompt {P} tokens, {N} new tokens, "
              f"max_model_len {llm.engine.max_len}; jax {jax.__version__} on "
              f"{jax.devices()[0].platform} ({cpu_name()}, {os.cpu_count()} cores); "
              f"LLM(model) load + warm-up {setup:.1f} s")
        gguf = None
        if args.llama_cpp and is_gguf(folder):
            gguf = Path(folder) if quantized else float32_gguf(llm, Path(folder), tmp)
        if args.llama_cpp and gguf is None:
            print("  (--llama-cpp: llama.cpp is timed on GGUF models only)")
        rng = np.random.default_rng(0)
        full = SamplingParams(max_tokens=N, ignore_eos=True)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        position = P + N // 2
        tab = table(N, P, args.repeats, position, roofline=1 in args.batch_sizes,
                    verify=bool(args.verify_len))
        rows = []
        with _hf_child(None if args.no_hf else folder) as hf_side, \
                llama_cpp_child(args.llama_cpp, gguf, P + N + 16) as lcpp_side:
            if hf_side is not None:
                pool, versions = hf_side
                print(f"  (transformers side: {versions}; alternating, the best of "
                      f"{args.repeats} runs each)")
            if lcpp_side is not None:
                lcpp, version = lcpp_side
                given = ("the same GGUF file" if quantized
                         else "float32 GGUF of the same weights")
                print(f"  (llama.cpp side: llama-cpp-python {version}, {os.cpu_count()} "
                      f"threads, {given}; batch 1)")
            print("\n" + tab.header())
            for bsz in args.batch_sizes:
                prompts = rng.integers(0, cfg.vocab_size, size=(bsz, P)).tolist()
                llm.generate(prompts, full)  # warm (every shape is compiled already)
                sj = {"N": np.inf, "1": np.inf, "step": np.inf, "compiled": np.inf}
                hf = {"N": np.nan, "1": np.nan} if args.no_hf else {"N": np.inf, "1": np.inf}
                lc = ({"N": np.inf, "1": np.inf} if lcpp_side is not None and bsz == 1
                      else {"N": np.nan, "1": np.nan})
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
                    if hf_side is not None:
                        time.sleep(0.3)  # let the other side's idle threads go to sleep
                        t, ref = pool.apply(_hf_generate, (prompts, N))
                        hf["N"] = min(hf["N"], t)
                        hf["1"] = min(hf["1"], pool.apply(_hf_generate, (prompts, 1))[0])
                        same += sum(o.token_ids == r for o, r in zip(outs, ref))
                        time.sleep(0.3)
                    if lcpp_side is not None and bsz == 1:
                        lc["N"] = min(lc["N"], lcpp(prompts[0], N)[0])
                        lc["1"] = min(lc["1"], lcpp(prompts[0], 1)[0])
                        time.sleep(0.3)
                e2e = lambda d: bsz * N / d["N"]
                decode = lambda d: bsz * (N - 1) / (d["N"] - d["1"])
                host = sj["step"] - sj["compiled"]
                same_txt = "-" if args.no_hf else f"{same}/{bsz * args.repeats}"
                print(tab.row(bsz, e2e(sj), e2e(hf), e2e(sj) / e2e(hf), e2e(lc),
                              e2e(sj) / e2e(lc), decode(sj), decode(hf),
                              decode(sj) / decode(hf), decode(lc), sj["step"] * 1e3,
                              sj["compiled"] * 1e3, host * 1e3, host / sj["step"], same_txt),
                      flush=True)
                rows.append((bsz, sj))
            if hf_side is not None:
                _parity(llm, pool, args.parity_prompts)
        print("\n" + tab.legend())

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
