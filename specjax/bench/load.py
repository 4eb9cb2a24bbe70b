"""Loading: the time and peak memory of reading a model, and of `specjax.LLM` on it, each in a
fresh process.

Rows (each its own child process, so that one's peak is not another's): the model alone
(`registry.load_model`: the GGUF repacked for the kernel, nothing compiled), then `LLM(model)`
at the given sizes (the model, its tokenizer and the engine: weights in the steps' layout and
the K/V pool, before any step compiles), then with `--draft` the same with that model as a
draft-target drafter. Peak memory is the child's peak resident set (`ru_maxrss`), the
interpreter and JAX included; the file's size is printed beside it. A chunked model is joined
into the cache before the first row (not timed: it happens once).
"""
from __future__ import annotations

import argparse
import multiprocessing
import resource
import time

from specjax.analysis.timing import cpu_name
from specjax.bench.table import Column, Table
from specjax.models.registry import installed_help, resolve_model_path

TABLE = Table([
    Column("what", "what the child process did", 34, left=True),
    Column("seconds", "its wall time, from the call to the loaded object", 8),
    Column("peak GB", "the child's peak resident memory (interpreter and JAX included)", 8),
    Column("file GB", "the model file's size (a folder: its files')", 8),
])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b",
                        help=f"'bundled', {installed_help()}, a folder or a GGUF file")
    parser.add_argument("--draft", default=None,
                        help="a draft model to load beside it as a draft-target drafter "
                             "(e.g. qwen2.5-coder-0.5b)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="LLM's max_model_len (default: the model's positions)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="LLM's max_batch_size")


def _child(what: str, args: dict, queue) -> None:
    start = time.perf_counter()
    if what == "model":
        from specjax.models.registry import load_model
        load_model(resolve_model_path(args["model"]))
    else:
        from specjax.llm import LLM
        from specjax.speculative.config import DraftTargetConfig
        spec = (DraftTargetConfig(speculative_model=args["draft"]) if what == "draft"
                else None)
        LLM(args["model"], max_model_len=args["max_model_len"],
            max_batch_size=args["max_batch_size"], speculative_config=spec, progress=False)
    queue.put((time.perf_counter() - start,
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9))


def _size(path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e9


def run(args: argparse.Namespace) -> None:
    path = resolve_model_path(args.model)  # joins a chunked model once, outside the timing
    if args.draft:
        resolve_model_path(args.draft)
    length = args.max_model_len or "the model's own"
    print(f"Loading {args.model} ({path.name}) on {cpu_name()}: max_model_len {length}, "
          f"max_batch_size {args.max_batch_size}")
    print(TABLE.header())
    rows = [("model", f"load_model({args.model!r})"), ("llm", f"LLM({args.model!r})")]
    if args.draft:
        rows.append(("draft", f"LLM(..., draft {args.draft!r})"))
    context = multiprocessing.get_context("spawn")
    for what, label in rows:
        queue = context.Queue()
        child = context.Process(target=_child, args=(what, vars(args), queue))
        child.start()
        seconds, peak = queue.get()
        child.join()
        size = _size(path) + (_size(resolve_model_path(args.draft)) if what == "draft" else 0)
        print(TABLE.row(label, seconds, peak, size), flush=True)
    print(TABLE.legend())
