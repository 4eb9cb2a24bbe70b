"""Structured output with and without speculation: tok/s of constrained requests (JSON
schemas, regular expressions, choices) against the same requests unconstrained, plain decoding
and EAGLE-3 side by side, and the share of the run the host spent computing token masks.

The unconstrained requests generate exactly as many tokens as their constrained twins did
(`ignore_eos`, `max_tokens` = the constrained output's length), so both sides do the same
amount of decoding. Constrained steps are read before the next one is dispatched (their masks
need the tokens just accepted); unconstrained ones overlap, so the "free, no overlap" column
shows how much of the difference is the lost overlap. Runs alternate and each keeps its
fastest of `--repeats`; every speculative output is checked equal to plain decoding's.

The cases (also the tests' cases: tests/engine/test_structured_output.py) are JSON schemas
whose every output is bounded (strings, arrays and numbers have limits, so a model cannot run
past `max_tokens` inside one), regular expressions and choices, after code prompts.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from specjax.analysis import output_acceptance
from specjax.bench.table import Column, Table
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import EagleConfig

S = {"type": "string", "maxLength": 10}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                          "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "integer", "minimum": 1,
                                                "maximum": 9}},
     "required": ["color", "shade"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "y": {"type": "integer", "minimum": 0,
                                               "maximum": 999}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                                                           "maximum": 9},
                                                          {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{6}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"path": {"type": "string", "maxLength": 16},
                                      "mode": {"enum": ["r", "w", "a"]},
                                      "binary": {"type": "boolean"}},
     "required": ["path", "mode", "binary"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"enum": ["open", "read", "close"]},
                                      "args": {"type": "array", "items": S, "maxItems": 2}},
     "required": ["function", "args"], "additionalProperties": False},
    {"type": "string", "maxLength": 12},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"enum": ["def", "class", "import", "return"]},
    {"type": "object", "properties": {"a": {"const": "fixed"}, "b": {"type": "boolean"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"rows": {
        "type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"k": S, "v": {"type": "integer", "minimum": 0,
                                                           "maximum": 99}},
            "required": ["k", "v"], "additionalProperties": False}}},
     "required": ["rows"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]},
                                      "code": {"type": "integer", "minimum": 0,
                                               "maximum": 599},
                                      "message": {"type": "string", "maxLength": 20}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"name": S, "admin": {"type": "boolean"}},
        "required": ["name", "admin"], "additionalProperties": False},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 3}},
     "required": ["user", "ids"], "additionalProperties": False},
]

PROMPTS = ["def parse(text):\n    return ", "import json\n\nconfig = ",
           "class Point:\n    def __init__(self, x, y):\n        "]

REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(def|class) [a-z_]{1,8}\(\)", r"0x[0-9a-f]{2,6}",
           r"[A-Z][a-z]{1,6}( [a-z]{1,5}){0,2}\."]
CHOICES = [["True", "False"], ["os.path", "sys.argv", "re.compile"], ["return x", "return y"]]


def cases(max_tokens: int = 96) -> list[tuple[str, SamplingParams]]:
    """(prompt, constrained parameters): every schema after every prompt, then each regular
    expression and each choice list after the first two prompts."""
    out = [(p, SamplingParams(max_tokens=max_tokens, guided_json=s))
           for s in SCHEMAS for p in PROMPTS]
    out += [(p, SamplingParams(max_tokens=32, guided_regex=r)) for r in REGEXES
            for p in PROMPTS[:2]]
    out += [(p, SamplingParams(max_tokens=16, guided_choice=c)) for c in CHOICES
            for p in PROMPTS[:2]]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8,
                        help="requests in flight at once (max_batch_size)")
    parser.add_argument("--max-draft-len", type=int, default=4, help="EAGLE-3's D")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per column; the fastest is kept")


@dataclasses.dataclass
class Timed:
    seconds: float = float("inf")
    tokens: int = 0
    al: float | None = None
    per_step: float = 0.0
    mask_share: float = 0.0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def timed(llm: LLM, prompts, params, best: Timed) -> list:
    llm.reset_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    if seconds < best.seconds:
        stats = llm.stats
        best.seconds, best.tokens = seconds, sum(len(o.token_ids) for o in outs)
        best.al = stats.acceptance_length
        best.per_step = output_acceptance(outs)["per_step"]
        best.mask_share = stats.mask_time / seconds
    return outs


def table() -> Table:
    return Table([
        Column("method", "decoding", 14, left=True),
        Column("free tok/s", "unconstrained twins (same output lengths), overlap on", 10,
               "{:.0f}"),
        Column("no-overlap", "the same, overlap scheduler off", 10, "{:.0f}"),
        Column("constr tok/s", "the constrained requests", 12, "{:.0f}"),
        Column("constr/free", "constrained tok/s / free tok/s", 11),
        Column("AL free", "acceptance length, unconstrained", 7),
        Column("AL constr", "acceptance length, constrained (over steps that verified a "
               "draft the grammar allowed)", 9),
        Column("tok/step", "tokens per decoding step after the first token, free / "
               "constrained (steps whose drafts the grammar cut count too)", 11, "{}"),
        Column("mask share", "host time computing token masks / the constrained run's time",
               10, "{:.1%}"),
    ], notes=[("speedup", "EAGLE-3's tok/s / plain decoding's, per column")])


def run(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.repeats < 1:
        raise SystemExit("--batch-size and --repeats must be >= 1")
    prompts, constrained = map(list, zip(*cases()))
    common = dict(max_batch_size=args.batch_size, max_model_len=256, prefill_chunk=32,
                  progress=False, warmup=True)
    engines = {"plain": (LLM("bundled", **common),
                         LLM("bundled", overlap_scheduler=False, **common)),
               f"EAGLE-3 D={args.max_draft_len}": tuple(
                   LLM("bundled", speculative_config=EagleConfig(max_draft_len=args.max_draft_len),
                       overlap_scheduler=overlap, **common) for overlap in (True, False))}
    reference = engines["plain"][0].generate(prompts, constrained)
    free = [SamplingParams(max_tokens=len(o.token_ids), ignore_eos=True) for o in reference]
    free_ref = engines["plain"][0].generate(prompts, free)
    print(f"bundled target, {len(prompts)} requests ({len(SCHEMAS)} schemas x {len(PROMPTS)} "
          f"prompts, {len(REGEXES)} regexes, {len(CHOICES)} choice lists), "
          f"{sum(len(o.token_ids) for o in reference)} tokens, batch {args.batch_size}, greedy, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    results = {name: (Timed(), Timed(), Timed()) for name in engines}
    for _ in range(args.repeats):
        for name, (llm, sync_llm) in engines.items():
            f, nf, c = results[name]
            outs = timed(llm, prompts, constrained, c)
            assert [o.token_ids for o in outs] == [o.token_ids for o in reference], name
            outs = timed(llm, prompts, free, f)
            assert [o.token_ids for o in outs] == [o.token_ids for o in free_ref], name
            timed(sync_llm, prompts, free, nf)
    tab = table()
    print("\n" + tab.header())
    for name, (f, nf, c) in results.items():
        print(tab.row(name, f.tps, nf.tps, c.tps, c.tps / f.tps, f.al or float("nan"),
                      c.al or float("nan"), f"{f.per_step:.2f}/{c.per_step:.2f}",
                      c.mask_share))
    (pf, pnf, pc), (ef, enf, ec) = results.values()
    print(f"\nspeedup of EAGLE-3 over plain: free {ef.tps / pf.tps:.2f}x, no-overlap "
          f"{enf.tps / pnf.tps:.2f}x, constrained {ec.tps / pc.tps:.2f}x")
    print(tab.legend())
