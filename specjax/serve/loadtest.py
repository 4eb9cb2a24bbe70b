"""`python -m specjax.serve.loadtest --url http://127.0.0.1:8000 --clients 32 --max-tokens 64`

Opens `--clients` concurrent streaming /v1/completions requests (greedy, `ignore_eos` so each
asks for exactly `--max-tokens`), then prints requests, total tokens/s and time to first token.
Tokens are counted from each stream's final `usage`, not from its chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from typing import Any

try:
    import httpx
except ImportError:  # the `loadtest` extra; main() says so before doing anything
    httpx = None

from specjax.cli import HelpFormatter, require


@dataclasses.dataclass
class StreamResult:
    status: int
    completed: bool = False           # the stream ended with data: [DONE]
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    ttft: float | None = None         # seconds to the first chunk carrying text
    latency: float = 0.0
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            headers: dict[str, str]) -> StreamResult:
    """One streaming completion, read to the end."""
    start = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                  headers=headers) as response:
            result = StreamResult(response.status_code)
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.completed = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message")
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("text") and result.ttft is None:
                        result.ttft = time.perf_counter() - start
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except httpx.HTTPError as e:
        result = StreamResult(0, error=f"{type(e).__name__}: {e}")
    result.latency = time.perf_counter() - start
    return result


async def run_load(url: str, clients: int, max_tokens: int, api_key: str | None = None,
                   model: str | None = None, prompt: str = "def function_{i}(x):",
                   ignore_eos: bool = True, timeout: float = 600.0
                   ) -> tuple[list[StreamResult], float]:
    """Start `clients` streams at once; returns their results and the wall time."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            listed = await client.get(f"{url}/v1/models", headers=headers)
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": prompt.format(i=i), "max_tokens": max_tokens,
                   "temperature": 0, "ignore_eos": ignore_eos} for i in range(clients)]
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, url, b, headers)
                                         for b in bodies))
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def summarize(results: list[StreamResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.completed and r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "total_tokens": tokens, "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "latency_p50_s": percentile([r.latency for r in ok], 50),
            "latency_p99_s": percentile([r.latency for r in ok], 99)}


def format_summary(s: dict[str, Any]) -> str:
    ms = lambda v: "n/a" if v is None else f"{1000 * v:.0f} ms"
    return (f"requests: {s['requests']} ({s['completed']} completed, {s['failed']} failed)\n"
            f"tokens: {s['total_tokens']} in {s['elapsed_s']:.2f} s = "
            f"{s['tokens_per_s']:.1f} tokens/s\n"
            f"time to first token: p50 {ms(s['ttft_p50_s'])}, p99 {ms(s['ttft_p99_s'])}\n"
            f"request latency: p50 {ms(s['latency_p50_s'])}, p99 {ms(s['latency_p99_s'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.serve.loadtest", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--clients", type=int, default=32,
                        help="concurrent streaming requests, one per client")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request asks for")
    parser.add_argument("--model", default=None, help="the model to ask for (default: the first of /v1/models)")
    parser.add_argument("--prompt", default="def function_{i}(x):",
                        help="'{i}' becomes the client's index")
    parser.add_argument("--api-key", default=os.environ.get("SPECJAX_API_KEY"),
                        help="sent as a bearer token (from $SPECJAX_API_KEY when set)")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let requests stop at EOS (then token counts vary)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each request may take")
    args = parser.parse_args(argv)
    require("python -m specjax.serve.loadtest", "httpx")
    if args.clients < 1 or args.max_tokens < 1:
        parser.error("--clients and --max-tokens must be >= 1")
    results, elapsed = asyncio.run(run_load(
        args.url, args.clients, args.max_tokens, args.api_key, args.model, args.prompt,
        not args.no_ignore_eos, args.timeout))
    print(format_summary(summarize(results, elapsed)))
    errors = [r.error for r in results if r.error]
    for e in errors[:3]:
        print(f"error: {e}", file=sys.stderr)
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
