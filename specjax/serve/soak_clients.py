"""The soak's clients (`python -m specjax.serve.soak`): the request mix -- prompts, sampling
and seed pools, streaming, plain and abandoned requests, injected bad ones --, what every answer
must be, and the server's state once they stop (`run_soak` -> `SoakReport`)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import signal
import time
from typing import Any

try:
    import httpx
except ImportError:  # the `loadtest` extra; the soak's main() says so before doing anything
    httpx = None

from specjax.serve.loadtest import StreamResult, percentile, stream_completion

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Small pools, so that the same (prompt, parameters) key recurs and can be compared.
SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 0}, {"temperature": 0.5}, {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 40}, {"temperature": 1.0, "top_p": 0.95, "top_k": 100})
MAX_TOKENS_LADDER = (8, 24, 64, 160, 300)   # plus the most that fits, to fill the context
WORDS = ("alpha", "beta", "gamma", "delta", "value", "index", "result", "buffer", "queue",
         "token", "cache", "block")
# A byte-level tokenizer gives at most one token per byte and a chat template adds fewer than
# this many, so a prompt's bytes + TEMPLATE_SLACK bounds its tokens until `usage` tells.
TEMPLATE_SLACK = 48
INJECTED = ("top_k_overflow", "lone_surrogate", "over_context", "invalid_json",
            "unknown_model", "too_many_stops")
Key = tuple[str, int, int, int, int]   # endpoint, prompt, max_tokens, sampling, seed


@dataclasses.dataclass
class SoakConfig:
    url: str
    api_key: str | None = None
    duration: float = 600.0
    clients: int = 32
    max_tokens_cap: int = 300          # keep within the server's --max-tokens-cap
    prompts: int = 16
    seeds: int = 2
    seed: int = 0                      # of the clients' choices, for a reproducible mix
    inject_rate: float = 0.05
    repeat_rate: float = 0.3           # replays of an already completed key
    request_timeout: float = 300.0
    idle_timeout: float = 60.0


@dataclasses.dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected_429: int = 0
    lost: int = 0
    failed_unexpectedly: int = 0
    injected: int = 0
    injected_answered_wrong: int = 0
    checked: int = 0                   # completions compared with an earlier one of their key
    mismatched: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    server_idle: bool | None = None
    kv_blocks_total: float | None = None
    kv_blocks_free: float | None = None
    preemptions: float | None = None   # None: /metrics has no preemption counter
    engine_errors: float | None = None
    server_exit_code: int | None = None
    server_shutdown_s: float | None = None
    ttfts: list[float] = dataclasses.field(default_factory=list)
    injected_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    wrong_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: list[str] = dataclasses.field(default_factory=list)

    def note(self, problem: str) -> None:
        if len(self.problems) < 20:   # examples, not a log
            self.problems.append(problem[:400])

    @property
    def leaked(self) -> float | None:
        if self.kv_blocks_total is None or self.kv_blocks_free is None:
            return None
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def server_exited_cleanly(self) -> bool:
        # uvicorn re-raises the SIGTERM it caught once it has shut down gracefully.
        return self.server_exit_code in (0, -signal.SIGTERM)

    def failures(self, spawned: bool = False) -> list[str]:
        counts = {"lost": self.lost, "mismatched": self.mismatched,
                  "failed unexpectedly": self.failed_unexpectedly,
                  "injected answered wrong": self.injected_answered_wrong,
                  "engine errors": self.engine_errors}
        out = [f"{name}: {n}" for name, n in counts.items() if n]
        if self.leaked is None:
            out.append("no KV block gauges in /metrics")
        elif self.leaked:
            out.append(f"KV blocks leaked: {self.leaked:g}")
        if not self.server_idle:
            out.append("the server did not go idle")
        if spawned and not self.server_exited_cleanly:
            out.append(f"the server did not exit cleanly (code {self.server_exit_code})")
        return out

    def figures(self) -> dict[str, Any]:
        lists = {"ttfts", "injected_by_kind", "wrong_by_kind", "problems"}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in lists}
        out.update(kv_blocks_leaked=self.leaked, ttft_p50_s=percentile(self.ttfts, 50),
                   ttft_p99_s=percentile(self.ttfts, 99),
                   tokens_per_s=self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0,
                   injected_by_kind={k: {"sent": self.injected_by_kind[k],
                                         "answered_wrong": self.wrong_by_kind[k]}
                                     for k in INJECTED},
                   problems=self.problems)
        return out


def make_prompt(index: int, max_bytes: int) -> str:
    """Code-like text of 1-60 lines (log-uniform: short prompts are common), one per index."""
    rng = random.Random(index)
    w = lambda: rng.choice(WORDS)
    lines = [f"# module {index}: {w()} {w()}"]
    for j in range(round(60 ** rng.random())):
        lines.append(rng.choice([f"x = {j}", f"{w()}_{j} = {w()}[{j}]",
                                 f"def {w()}_{j}(a, b):\n    return a + b * {j}",
                                 f'print("{w()} {w()}", {j})']))
    text = ""
    for line in lines:
        if len((text + line + "\n").encode()) > max_bytes:
            break
        text += line + "\n"
    return text or lines[0][:max(1, max_bytes)]


def with_prompt(path: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    if path == COMPLETIONS:
        return {**body, "prompt": text}
    return {**body, "messages": [{"role": "user", "content": text}]}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name (with its labels, if any): value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


class Soak:
    def __init__(self, config: SoakConfig, client: httpx.AsyncClient, model: str, max_len: int):
        self.config, self.client, self.model, self.max_len = config, client, model, max_len
        self.url = config.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.report = SoakReport()
        self.prompts = [make_prompt(i, max(8, max_len - TEMPLATE_SLACK - 8))
                        for i in range(config.prompts)]
        self.weights = [1 / (i + 1) for i in range(config.prompts)]   # hot keys recur
        self.prompt_tokens: dict[tuple[str, int], int] = {}   # learned from `usage`
        self.first_text: dict[Key, str] = {}
        self.keys: list[Key] = []
        self.baseline: dict[str, float] = {}   # /metrics before the soak: figures are rises

    def room(self, path: str, index: int) -> int:
        """The largest max_tokens this prompt surely has room for."""
        used = self.prompt_tokens.get((path, index))
        if used is None:
            used = len(self.prompts[index].encode()) + TEMPLATE_SLACK
        return max(1, min(self.config.max_tokens_cap, self.max_len - used))

    def new_key(self, rng: random.Random) -> Key:
        path = rng.choice((COMPLETIONS, CHAT))
        index = rng.choices(range(len(self.prompts)), self.weights)[0]
        room = self.room(path, index)
        max_tokens = rng.choice([m for m in MAX_TOKENS_LADDER if m < room] + [room])
        return (path, index, max_tokens, rng.randrange(len(SAMPLING)),
                rng.randrange(self.config.seeds))

    def body(self, key: Key) -> dict[str, Any]:
        path, index, max_tokens, sampling, seed = key
        return with_prompt(path, {"model": self.model, "max_tokens": max_tokens,
                                  **SAMPLING[sampling], "seed": 1000 + seed}, self.prompts[index])

    async def client_loop(self, number: int, deadline: float) -> None:
        rng = random.Random(self.config.seed * 100_003 + number)
        while time.monotonic() < deadline:
            if rng.random() < self.config.inject_rate:
                await self.inject(rng)
                continue
            replay = self.keys and rng.random() < self.config.repeat_rate
            key = rng.choice(self.keys) if replay else self.new_key(rng)
            if await self.generate(rng, key) == 429:
                await asyncio.sleep(rng.uniform(0.05, 0.3))

    async def generate(self, rng: random.Random, key: Key) -> int:
        """One request of `key`, streamed, plain or abandoned; returns its HTTP status."""
        body, path, timeout = self.body(key), key[0], self.config.request_timeout
        mode = rng.choices(("stream", "plain", "abandon"), (70, 15, 15))[0]
        self.report.sent += 1
        abandoned = False
        try:
            if mode == "plain":
                result = await asyncio.wait_for(self.post(path, body), timeout)
            elif mode == "stream" and path == COMPLETIONS:
                result = await asyncio.wait_for(stream_completion(
                    self.client, self.url, body, self.headers), timeout)
            else:
                after = rng.randint(1, 4) if mode == "abandon" else None
                result, abandoned = await asyncio.wait_for(self.stream(path, body, after),
                                                           timeout)
        except TimeoutError:
            result = StreamResult(0, error=f"no answer within {timeout:g} s")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            result = StreamResult(-1, error=f"malformed response: {type(e).__name__}: {e}")
        self.record(key, mode, result, abandoned)
        return result.status

    async def post(self, path: str, body: dict[str, Any]) -> StreamResult:
        try:
            response = await self.client.post(self.url + path, json=body, headers=self.headers)
        except httpx.HTTPError as e:
            return StreamResult(0, error=f"{type(e).__name__}: {e}")
        result = StreamResult(response.status_code)
        if response.status_code != 200:
            result.error = response.text[:300]
            return result
        payload = response.json()
        choice = payload["choices"][0]
        result.text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
        result.finish_reason = choice["finish_reason"]
        result.completion_tokens = payload["usage"]["completion_tokens"]
        result.prompt_tokens = payload["usage"]["prompt_tokens"]
        result.completed = True
        return result

    async def stream(self, path: str, body: dict[str, Any], abandon_after: int | None
                     ) -> tuple[StreamResult, bool]:
        """`stream_completion` for either endpoint, closing the connection after
        `abandon_after` chunks if given; returns (result, whether it was abandoned)."""
        start, chunks = time.perf_counter(), 0
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.client.stream("POST", self.url + path, json=body,
                                          headers=self.headers) as response:
                result = StreamResult(response.status_code)
                if response.status_code != 200:
                    result.error = (await response.aread()).decode(errors="replace")[:300]
                    return result, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        result.completed = True
                        break
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:300]
                        break
                    for choice in chunk["choices"]:
                        piece = (choice["text"] if path == COMPLETIONS
                                 else choice["delta"].get("content"))
                        if piece and result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        result.text += piece or ""
                        result.finish_reason = choice["finish_reason"] or result.finish_reason
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
                        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    chunks += 1
                    if abandon_after is not None and chunks >= abandon_after:
                        return result, True
        except httpx.HTTPError as e:
            return StreamResult(0, error=f"{type(e).__name__}: {e}"), False
        result.latency = time.perf_counter() - start
        return result, False

    def record(self, key: Key, mode: str, result: StreamResult, abandoned: bool) -> None:
        r, where, max_tokens = self.report, f"{mode} {key}", key[2]
        if result.status == 429:
            r.rejected_429 += 1
        elif result.status == 0 or (result.status == 200 and result.error is None
                                    and not result.completed and not abandoned):
            r.lost += 1
            r.note(f"lost: {where}: {result.error or 'the stream ended without [DONE]'}")
        elif result.status != 200 or result.error is not None:
            r.failed_unexpectedly += 1
            r.note(f"failed: {where}: status {result.status}: {result.error}")
        elif abandoned:
            r.disconnected += 1
        elif result.finish_reason is None or result.completion_tokens > max_tokens or (
                result.finish_reason == "length" and result.completion_tokens != max_tokens):
            r.failed_unexpectedly += 1
            r.note(f"failed: {where}: finish_reason {result.finish_reason!r} with "
                   f"{result.completion_tokens} tokens in usage")
        else:
            r.completed += 1
            r.completion_tokens += result.completion_tokens
            if mode != "plain" and result.ttft is not None:
                r.ttfts.append(result.ttft)
            if result.prompt_tokens:
                self.prompt_tokens[key[:2]] = result.prompt_tokens
            if key not in self.first_text:
                self.first_text[key] = result.text
                self.keys.append(key)
                return
            r.checked += 1
            if result.text != self.first_text[key]:
                r.mismatched += 1
                r.note(f"mismatch: {where}: {self.first_text[key][:80]!r} then "
                       f"{result.text[:80]!r}")

    async def inject(self, rng: random.Random) -> None:
        """One bad request; it must get a 4xx (not 429) with an OpenAI-style error body."""
        kind = rng.choice(INJECTED)
        key = self.new_key(rng)
        path = key[0]
        body = {**self.body(key), "stream": rng.random() < 0.5}
        if kind == "top_k_overflow":
            body["top_k"] = 2**31
        elif kind == "unknown_model":
            body["model"] = "no-such-model"
        elif kind == "too_many_stops":
            body["stop"] = [f"stop{i}" for i in range(16)]
        elif kind == "lone_surrogate":
            # json.dumps writes it as the escape \ud800: valid JSON with no UTF-8 encoding.
            body = with_prompt(path, body, "ab\ud800cd")
        elif kind == "over_context":
            known = [(p, i) for p, i in self.prompt_tokens if p == path]
            if known:  # one token more than the context holds
                index = rng.choice(known)[1]
                body = with_prompt(path, body, self.prompts[index])
                body["max_tokens"] = self.max_len - self.prompt_tokens[path, index] + 1
            else:
                body = with_prompt(path, body, "x = 1\n" * self.max_len)
        content = json.dumps(body).encode()
        if kind == "invalid_json":
            content = content[:-1]
        r = self.report
        r.sent += 1
        r.injected += 1
        r.injected_by_kind[kind] += 1
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            response = await asyncio.wait_for(self.client.post(
                self.url + path, content=content, headers=headers), self.config.request_timeout)
            payload = response.json() if response.text.startswith("{") else None
            error = payload.get("error") if isinstance(payload, dict) else None
            if (400 <= response.status_code < 500 and response.status_code != 429
                    and isinstance(error, dict) and isinstance(error.get("message"), str)):
                return
            problem = f"status {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, TimeoutError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
        r.injected_answered_wrong += 1
        r.wrong_by_kind[kind] += 1
        r.note(f"injected {kind} on {path} answered wrong: {problem}")

    async def read_baseline(self) -> None:
        response = await self.client.get(self.url + "/metrics", headers=self.headers)
        self.baseline = parse_metrics(response.text)

    async def settle(self) -> None:
        """Wait for the server to go idle, then read the KV pool and the engine counters' rise
        during the soak (a server may have served other requests before)."""
        r, deadline, m = self.report, time.monotonic() + self.config.idle_timeout, {}
        while True:
            try:
                response = await self.client.get(self.url + "/metrics", headers=self.headers)
                m = parse_metrics(response.text)
            except (httpx.HTTPError, ValueError) as e:
                r.note(f"/metrics: {type(e).__name__}: {e}")
            r.kv_blocks_free = m.get("specjax_kv_blocks_free")
            r.kv_blocks_total = m.get("specjax_kv_blocks_total")
            r.server_idle = (m.get("specjax_requests_running") == 0
                             and m.get("specjax_requests_waiting") == 0)
            if (r.server_idle and r.leaked == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        names = {k: k.split("{")[0] for k in m}
        preempt = [v - self.baseline.get(k, 0.0) for k, v in m.items()
                   if "preempt" in names[k] and not names[k].endswith("_created")]
        r.preemptions = sum(preempt) if preempt else None
        errors = 'specjax_requests_total{outcome="error"}'
        r.engine_errors = (m.get(errors, 0.0) - self.baseline.get(errors, 0.0)) if m else None


async def run_soak(config: SoakConfig) -> SoakReport:
    """The soak itself, against `config.url`; returns the figures (nothing is printed)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.clients + 4,
                          max_keepalive_connections=config.clients + 4)
    timeout = httpx.Timeout(config.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        listed = await client.get(config.url.rstrip("/") + "/v1/models", headers=headers)
        listed.raise_for_status()
        served = listed.json()["data"][0]
        soak = Soak(config, client, served["id"], int(served["max_model_len"]))
        await soak.read_baseline()
        start = time.monotonic()
        # Requests in flight at the deadline run to their end: none is cut short here.
        await asyncio.gather(*(soak.client_loop(i, start + config.duration)
                               for i in range(config.clients)))
        soak.report.elapsed_s = time.monotonic() - start
        await soak.settle()
    return soak.report
