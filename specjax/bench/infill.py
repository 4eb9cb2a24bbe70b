"""Editor completions: `/infill` time to first token as llama.vim asks, cold and after its
warm-up request, over HTTP against the real server.

The server (`python -m specjax.serve` at its defaults but for the sizes given, in a child
process; timed once its background warm-up is done and a first request has run, so no step
compiles while timing). The prefix is `--prefix-lines` lines of a real source file (the standard library's
`argparse.py`: local, the same everywhere), the suffix the `--suffix-lines` after them
(llama.vim's defaults: 256 and 64), the cursor at the start of the line between them. Rows:
the cold request (nothing cached), a warm-up (`n_predict: 0`, as llama.vim sends while the user
types), then the keystroke's request (the same context, one character typed: `prompt`), whose
extra chunk and prefix the warm-up left in the prefix cache. Each streams and is timed to its
first `content` chunk; `cached` is the prompt tokens its prefill skipped.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time

from specjax.analysis.timing import cpu_name
from specjax.bench.table import Column, Table
from specjax.cli import require
from specjax.models.registry import installed_help

TABLE = Table([
    Column("request", "which request (module docstring)", 24, left=True),
    Column("prompt tok", "prompt tokens the request's prefill had (tokens_evaluated)", 10, "{:d}"),
    Column("cached", "of them, tokens read from the prefix cache (not computed)", 7, "{:d}"),
    Column("TTFT ms", "request sent to first content chunk received", 8, "{:.0f}"),
    Column("total ms", "request sent to the last chunk", 9, "{:.0f}"),
])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b",
                        help=f"a model with FIM tokens: {installed_help()}, or a GGUF file")
    parser.add_argument("--prefix-lines", type=int, default=256, help="lines before the cursor")
    parser.add_argument("--suffix-lines", type=int, default=64, help="lines after it")
    parser.add_argument("--n-predict", type=int, default=32, help="tokens a completion asks")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="the server's max_model_len (FIM context and K/V pool)")


def _context(prefix_lines: int, suffix_lines: int) -> tuple[str, str, list[dict]]:
    # the bench's code context: a real source file, the same everywhere
    lines = inspect.getsource(argparse).splitlines(keepends=True)
    start = min(1200, max(0, len(lines) - prefix_lines - suffix_lines - 1))
    prefix = "".join(lines[start:start + prefix_lines])
    suffix = "".join(lines[start + prefix_lines + 1:start + prefix_lines + 1 + suffix_lines])
    extra = [{"filename": "argparse_head.py", "text": "".join(lines[:60])}]
    return prefix, suffix, extra


def run(args: argparse.Namespace) -> None:
    require("python -m specjax.bench infill", "httpx")
    import httpx

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "specjax.serve", "--model", args.model, "--port", str(port),
         "--max-model-len", str(args.max_model_len), "--max-batch-size", "1",
         "--log-level", "warning"], start_new_session=True)
    prefix, suffix, extra = _context(args.prefix_lines, args.suffix_lines)
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
            "prompt": "", "n_predict": args.n_predict, "stream": True, "temperature": 0}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
            _wait_warm(client, server)
            # Every program these requests run, compiled before the timing: other text.
            _timed(client, {**body, "input_prefix": suffix, "input_suffix": prefix,
                            "input_extra": [{"filename": "other.py", "text": suffix}]})
            print(f"/infill on {args.model}, {cpu_name()}: a {args.prefix_lines}-line prefix, "
                  f"{args.suffix_lines}-line suffix, one extra chunk, n_predict "
                  f"{args.n_predict}")
            print(TABLE.header())
            for label, change in (("cold", {}), ("warm-up (n_predict 0)", {"n_predict": 0}),
                                  ("keystroke after warm-up", {"prompt": " "})):
                print(TABLE.row(label, *_timed(client, {**body, **change})), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=120)
    print(TABLE.legend())


def _wait_warm(client, server) -> None:
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}) before answering")
        try:
            if not client.get("/health").json().get("warming_up", True):
                return
        except Exception:  # not listening yet
            pass
        time.sleep(1)


def _timed(client, body: dict) -> tuple[int, int, float, float]:
    start, first, final = time.perf_counter(), None, {}
    with client.stream("POST", "/infill", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if first is None and (event.get("content") or event.get("stop")):
                first = time.perf_counter()
            if event.get("stop"):
                final = event
    end = time.perf_counter()
    timings = final.get("timings", {})
    evaluated = int(final.get("tokens_evaluated", timings.get("prompt_n", 0)))
    cached = int(final.get("tokens_cached", timings.get("cache_n", 0)))
    return evaluated, cached, (first - start) * 1e3, (end - start) * 1e3
