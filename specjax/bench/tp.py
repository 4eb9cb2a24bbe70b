"""Tensor parallelism: generation throughput at each tensor-parallel size, side by side, and
whether every size gave the tokens one device gave.

Each size builds its engine (warmed up), then times `LLM.generate` of --batch-size greedy
requests (best of --rounds). A size needs that many devices: on a multi-GPU host they are the
GPUs; on a CPU, ask XLA for several host devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m specjax.bench tp`. CPU host
devices share the same cores, so there the figures show the cost of the collectives, not a
speed-up.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from specjax.bench.table import Column, Table

TABLE = Table([
    Column("tp", "devices the target is split over (tensor_parallel_size)", 4, "{:d}"),
    Column("tok/s", "generated tokens per second, best round", 9, "{:.1f}"),
    Column("vs tp=1", "tok/s relative to one device, same run", 8, "{:.2f}"),
    Column("same tokens", "every request's tokens equal one device's", 12, left=True),
])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specjax.bench.decode import RANDOM_NAME
    parser.add_argument("--model", default=RANDOM_NAME,
                        help=f"'{RANDOM_NAME}' (a random 27.8M Llama, 8 heads and 4 KV heads: "
                             "splits 1, 2, 4 and 8 ways), 'bundled' (4 heads, 2 KV heads), or a "
                             "checkpoint folder")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4],
                        help="tensor-parallel sizes to time")
    parser.add_argument("--batch-size", type=int, default=4, help="requests per generate call")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed generate calls per size")


def run(args: argparse.Namespace) -> None:
    import jax
    from flax import nnx

    from specjax import LLM, SamplingParams
    from specjax.bench.decode import RANDOM_28M, RANDOM_NAME
    from specjax.models import Llama, save_hf_checkpoint

    if max(args.sizes) > jax.device_count():
        raise SystemExit(f"--sizes up to {max(args.sizes)} need as many devices; "
                         f"{jax.device_count()} here (on a CPU: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={max(args.sizes)})")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    print(f"model {args.model}, batch {args.batch_size} x {args.max_tokens} tokens, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices")
    print(TABLE.header())
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == RANDOM_NAME:
            model = str(Path(tmp) / RANDOM_NAME)
            save_hf_checkpoint(Llama(RANDOM_28M, rngs=nnx.Rngs(0)), model)
        base = reference = None
        for size in [1] + [s for s in args.sizes if s != 1]:
            llm = LLM(model, tensor_parallel_size=size, max_batch_size=args.batch_size,
                      batch_sizes=(args.batch_size,), max_model_len=256, progress=False,
                      speculative_config=None, warmup=True)
            prompts = [[1, 2 + i, 3, 4] for i in range(args.batch_size)]
            best, tokens = float("inf"), None
            for _ in range(args.rounds):
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                best = min(best, time.perf_counter() - start)
                tokens = [o.token_ids for o in outs]
            rate = args.batch_size * args.max_tokens / best
            base, reference = base or rate, reference or tokens
            if size in args.sizes:
                print(TABLE.row(size, rate, rate / base, "yes" if tokens == reference else "NO"),
                      flush=True)
            del llm
    print(TABLE.legend())
