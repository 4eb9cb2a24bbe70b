"""`python -m specjax.serve.soak --spawn --duration 600 --clients 32`

A soak test of a running server (`--url`, `--api-key`) or of one started here (`--spawn`: on a
free loopback port, with a KV pool so small that requests are preempted all the time). For
`--duration` seconds `--clients` clients loop over random requests: streaming and
non-streaming /v1/completions and /v1/chat/completions, greedy and sampled, always seeded;
streams abandoned after a few chunks; and ~5% bad requests, which must be refused with a 4xx
and an OpenAI-style error body. A seeded (prompt, parameters) pair must give the same text
every time, preempted or not. Afterwards the server must go idle with every KV block free.

Prints one table; exits 1 if a request was lost (no [DONE], connection error, timeout), failed
unexpectedly, gave a different text than before, a bad request was answered wrong, or a KV
block leaked (or, with --spawn, if the server did not exit cleanly on SIGTERM).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

try:
    import httpx
except ImportError:  # the `loadtest` extra; main() says so before doing anything
    httpx = None

from specjax.cli import HelpFormatter, require
# parse_metrics is re-exported: the server tests read /metrics with `soak.parse_metrics`.
from specjax.serve.soak_clients import SoakConfig, SoakReport, parse_metrics, run_soak  # noqa: F401


class SpawnedServer:
    """`python -m specjax.serve` in a subprocess on a free loopback port, logging to a file."""

    def __init__(self, server_args: list[str]):
        with socket.socket() as sock:   # free now; the server binds it a moment later
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url, self.api_key = f"http://127.0.0.1:{port}", secrets.token_hex(16)
        log, self.log = tempfile.mkstemp(prefix="specjax-soak-server-", suffix=".log")
        command = [sys.executable, "-m", "specjax.serve", "--host", "127.0.0.1",
                   "--port", str(port), "--api-key", self.api_key, *server_args]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        os.close(log)

    def tail(self, lines: int = 15) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode}:\n"
                                   f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout:g} s:\n{self.tail()}")

    def stop(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM; returns (exit code, or None if it had to be killed; seconds taken)."""
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None, time.monotonic() - start
        return self.process.returncode, time.monotonic() - start


def format_table(report: SoakReport, spawned: bool) -> str:
    f, r = report.figures(), report
    ms = lambda v: "n/a" if v is None else f"{1000 * v:.0f} ms"
    num = lambda v: "n/a" if v is None else f"{v:g}"
    wrong = ", ".join(f"{k} {n}" for k, n in r.wrong_by_kind.items())
    rows = [("requests sent", r.sent, False), ("completed", r.completed, False),
            ("disconnected (deliberately)", r.disconnected, False),
            ("429 (queue full)", r.rejected_429, False), ("lost", r.lost, r.lost > 0),
            ("failed unexpectedly", r.failed_unexpectedly, r.failed_unexpectedly > 0),
            ("injected bad requests", r.injected, False),
            ("injected answered wrong", f"{r.injected_answered_wrong}"
             + (f" ({wrong})" if wrong else ""), r.injected_answered_wrong > 0),
            ("determinism checks", r.checked, False),
            ("mismatched", r.mismatched, r.mismatched > 0),
            ("TTFT p50 / p99", f"{ms(f['ttft_p50_s'])} / {ms(f['ttft_p99_s'])}", False),
            ("tokens/s", (f"{f['tokens_per_s']:.1f} ({r.completion_tokens} tokens in "
                          f"{r.elapsed_s:.0f} s)"), False),
            ("server idle afterwards", r.server_idle, not r.server_idle),
            ("KV blocks free / total", f"{num(r.kv_blocks_free)} / {num(r.kv_blocks_total)}",
             False),
            ("KV blocks leaked", num(r.leaked), r.leaked != 0),
            ("preemptions", "n/a (no counter in /metrics)" if r.preemptions is None
             else num(r.preemptions), False),
            ("engine errors (/metrics)", num(r.engine_errors), bool(r.engine_errors))]
    if spawned:
        shutdown = "killed" if r.server_exit_code is None else f"code {r.server_exit_code}"
        rows.append(("server exit on SIGTERM", f"{shutdown} after {r.server_shutdown_s:.1f} s",
                     not r.server_exited_cleanly))
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}{'   <-- FAIL' if bad else ''}"
                     for name, value, bad in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.serve.soak", description=__doc__,
                                     formatter_class=HelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument("--spawn", action="store_true", help="start `python -m specjax.serve`")
    parser.add_argument("--api-key", default=os.environ.get("SPECJAX_API_KEY"),
                        help="of a --url server (from $SPECJAX_API_KEY when set); a spawned "
                             "server gets a random one")
    parser.add_argument("--server-args", default="--kv-blocks 66",
                        help="more arguments of the spawned server (default: a KV pool that "
                             "holds one full-length request of the bundled model)")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds the clients keep sending requests")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--max-tokens-cap", type=int, default=300,
                        help="largest max_tokens a request draws")
    parser.add_argument("--prompts", type=int, default=16, help="size of the prompt pool")
    parser.add_argument("--seeds", type=int, default=2, help="size of the request seed pool")
    parser.add_argument("--seed", type=int, default=0, help="of the clients' random choices")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take before it counts as lost")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds a spawned server may take to answer /health")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds a spawned server may take to exit after SIGTERM")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    require("python -m specjax.serve.soak", "httpx")
    if min(args.clients, args.max_tokens_cap, args.prompts, args.seeds) < 1 or args.duration < 0:
        parser.error("--clients, --max-tokens-cap, --prompts and --seeds must be >= 1")
    server = SpawnedServer(shlex.split(args.server_args)) if args.spawn else None
    config = SoakConfig(url=server.url if server else args.url,
                        api_key=server.api_key if server else args.api_key,
                        duration=args.duration, clients=args.clients,
                        max_tokens_cap=args.max_tokens_cap, prompts=args.prompts,
                        seeds=args.seeds, seed=args.seed, request_timeout=args.request_timeout)
    try:
        if server:
            print(f"starting the server (log: {server.log}) ...", file=sys.stderr)
            server.wait_ready(args.startup_timeout)
        print(f"soaking {config.url} for {config.duration:g} s with {config.clients} clients",
              file=sys.stderr)
        report = asyncio.run(run_soak(config))
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        stopped = server.stop(args.shutdown_timeout) if server else None
    if stopped:
        report.server_exit_code, report.server_shutdown_s = stopped
    print(format_table(report, server is not None))
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.figures(), f, indent=2)
    failures = report.failures(spawned=server is not None)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
