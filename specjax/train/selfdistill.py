"""Training data from the target itself: `python -m specjax.train data --target smollm2 --out
DIR`. Prompts made locally (`specjax.train.prompts`: the standard library's docstrings, a topic
list, programming tasks, edits of given code and text, self-instruct), rendered through the
target's chat template and answered by the target with the engine, batched; SAVE_HIDDEN_STATES
writes the residual streams the heads train on (`DIR/hidden`, read by `python -m specjax.train
eagle3 | dflash --hidden-states DIR/hidden`). Prompts sharing a 6-word run with the bench's
held-out prompts are dropped. `DIR/progress.json`, rewritten after every chunk of answers, lets
`--resume` continue a stopped run; `DIR/manifest.json` records the prompts' sources, the
settings and what came out."""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from specjax.analysis.heldout import SPAN, overlaps_heldout
from specjax.train import prompts as P
from specjax.train.eagle3 import _layers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="the target: a name ('smollm2', 'bundled'), a folder or a GGUF file")
    p.add_argument("--out", type=Path, required=True, help="output folder (hidden/, manifest.json)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="layers to save, 0-based, the last one included for the labels (default: "
                        "EAGLE-3's three and the last)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap")
    p.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    p.add_argument("--self-instruct", type=int, default=256,
                   help="questions the target writes itself (then answers)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="every other prompt is answered at this temperature (seeded), the rest "
                        "greedily: the heads see both regimes")
    p.add_argument("--batch-size", type=int, default=32, help="requests decoded together")
    p.add_argument("--dtype", default="float32", help="the target's dtype")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts' order and of the sampled answers")
    p.add_argument("--answers", type=int, default=1,
                   help="answers per prompt: the extra ones are sampled with their own seeds "
                        "(more data from the same prompts); all first answers come first")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop submitting prompts once this much time has passed (the prompts "
                        "run in chunks of 4 batches; what was answered is kept and recorded)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out where it stopped (its progress.json is "
                        "rewritten after every chunk): the same settings, the answers not yet "
                        "written, into new files beside the old")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + answer cap (default: the model's context; a "
                        "shorter one lets a large batch fit)")
    e.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per row a step")
    e.add_argument("--max-prefill-rows", type=int, default=2, help="prompts prefilled a step")


def _params(i: int, temperature: float, max_tokens: int, seed: int, answer: int = 0):
    """Answer 0 of even-numbered prompts is greedy; every other answer is sampled, seeded by
    (seed, prompt, answer)."""
    from specjax import SamplingParams
    if (i % 2 == 0 and answer == 0) or temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                          seed=(seed * 1_000_003 + i) * 101 + answer)


PROGRESS = "progress.json"
# What a resumed run must share with the run it continues (its jobs are that run's).
RESUMED_SETTINGS = ("target", "dtype", "layers", "max_tokens", "temperature", "seed", "answers",
                    "self_instruct", "limit")


def _settings(args: argparse.Namespace) -> dict:
    return {"target": str(args.target), "dtype": args.dtype,
            "layers": None if args.layers is None else list(args.layers),
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "answers": args.answers, "self_instruct": args.self_instruct, "limit": args.limit}


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a run killed mid-write leaves the last complete file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _resumed(args: argparse.Namespace, out: Path) -> dict | None:
    """The progress of the run `--resume` continues (None for a new run), checked before any
    model loads."""
    hidden = out / "hidden"
    if not args.resume:
        if hidden.exists() and any(hidden.iterdir()):
            raise SystemExit(f"--out {out}: {hidden} already holds files; pick a new folder, or "
                             "--resume to continue the run that wrote them")
        return None
    if not (out / PROGRESS).is_file():
        raise SystemExit(f"--resume: {out / PROGRESS} is missing (nothing to continue)")
    progress = json.loads((out / PROGRESS).read_text())
    differ = [k for k in RESUMED_SETTINGS if progress["settings"].get(k) != _settings(args)[k]]
    if differ:
        raise SystemExit("--resume: the run in " + str(out) + " used other " + ", ".join(
            f"{k} ({progress['settings'].get(k)!r}, not {_settings(args)[k]!r})" for k in differ))
    return progress


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from specjax import LLM, SaveHiddenStatesConfig
    out: Path = args.out
    if args.answers < 1:
        raise SystemExit(f"--answers must be >= 1, got {args.answers}")
    if args.answers > 1 and args.temperature == 0:
        raise SystemExit("--answers > 1 needs --temperature > 0: greedy answers to the same "
                         "prompt are all the same")
    progress = _resumed(args, out)
    start = time.perf_counter()
    session = 0 if progress is None else progress["sessions"]
    # Each session writes its own files (part000_00000, part001_00000, ...).
    save = SaveHiddenStatesConfig(output_directory=str(out / "hidden"), layers=args.layers,
                                  write_interval=200, file_prefix=f"part{session:03d}")
    # One batch bucket: a data run decodes full batches until its last few steps, and every
    # other bucket would be one more compile of the whole target.
    llm = LLM(args.target, dtype=args.dtype, max_batch_size=args.batch_size,
              batch_sizes=(args.batch_size,),
              max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk,
              max_prefill_rows=args.max_prefill_rows, speculative_config=save)
    layers = llm.engine.recorder.layers
    rendered = lambda text: [{"role": "user", "content": text}]

    if progress is None:
        progress = _first_session(args, llm, rendered)
        progress["layers"] = list(layers)
    kept = [tuple(p) for p in progress["prompts"]]
    done = {tuple(job) for job in progress["answered"]}
    jobs = [(i, answer) for answer in range(args.answers) for i in range(len(kept))
            if (i, answer) not in done]
    chunk = 4 * args.batch_size
    for c in range(0, len(jobs), chunk):
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            print(f"--max-seconds {args.max_seconds:g}: stopping with {len(progress['answered'])}"
                  f" of {len(kept) * args.answers} answers", flush=True)
            break
        part = jobs[c:c + chunk]
        outputs = llm.chat([rendered(kept[i][1]) for i, _ in part],
                           [_params(i, args.temperature, args.max_tokens, args.seed, answer)
                            for i, answer in part], progress=True)
        # Written after every chunk: a run stopped any time resumes from the last one.
        llm.engine.recorder.flush()
        progress["answered"] += [list(job) for job in part]
        progress["answer_tokens"] += sum(len(o.token_ids) for o in outputs)
        for o in outputs:
            reasons = progress["finish_reasons"]
            reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
        progress["files"] = sorted(p.name for p in (out / "hidden").glob("*.safetensors"))
        _write_json(out / PROGRESS, progress)
    llm.engine.recorder.flush()
    llm.close()
    progress["sessions"] = session + 1
    progress["seconds"] = round(progress.get("seconds", 0.0) + time.perf_counter() - start, 1)
    progress["files"] = sorted(p.name for p in (out / "hidden").glob("*.safetensors"))
    _write_json(out / PROGRESS, progress)

    answered_jobs = [tuple(job) for job in progress["answered"]]
    sources: dict[str, int] = {}
    for i, _ in answered_jobs:
        sources[kept[i][0]] = sources.get(kept[i][0], 0) + 1
    # The first answers run in prompt order, so the prompts answered are a prefix of `kept`.
    n_prompts = len({i for i, _ in answered_jobs})
    manifest = {
        "target": str(args.target), "dtype": args.dtype, "layers": progress["layers"],
        "command": "python -m specjax.train data " + " ".join(argv[1:]),
        "sessions": progress["sessions"],
        "prompts": n_prompts, "prompts_made": len(kept),
        "answers": len(answered_jobs), "answers_per_prompt": args.answers,
        "answers_by_source": sources,
        "self_instruct": progress["self_instruct"],
        "heldout_dropped": progress["heldout_dropped"],
        "too_long_dropped": progress["too_long_dropped"],
        "heldout_rule": f"prompts sharing a {SPAN}-word run with specjax.analysis.heldout's "
                        "CHAT, CODE or EDIT prompts are dropped",
        "sampling": {"greedy": "even-numbered prompts' first answers",
                     "temperature": args.temperature, "top_p": 0.95,
                     "max_tokens": args.max_tokens},
        "answer_tokens": progress["answer_tokens"],
        "finish_reasons": progress["finish_reasons"],
        "files": progress["files"],
        "seconds": progress["seconds"],
        "prompt_texts": [{"source": s, "text": t} for s, t in kept[:n_prompts]],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(answered_jobs)} answers to {len(kept)} prompts "
          f"({progress['heldout_dropped']} dropped as held-out overlaps), "
          f"{progress['answer_tokens']:,} answer tokens in {manifest['seconds']:.0f} s -> {out}",
          flush=True)
    return 0


def _first_session(args: argparse.Namespace, llm, rendered) -> dict:
    """A new run's prompts -- made locally, the self-instruct questions the target writes
    first -- and its empty progress (`progress.json`, rewritten after every chunk)."""
    from specjax import SamplingParams
    from specjax.chat import ChatTemplate
    # A prompt that fills the context leaves no room for an answer (a short-context target).
    template = ChatTemplate.from_tokenizer(llm.tokenizer)
    fits = lambda text: len(template.prompt_ids(llm.tokenizer, rendered(text))) < \
        llm.engine.max_len

    # Self-instruct: the target writes questions, which join the prompts below.
    asks = [a for a in P.question_requests(args.self_instruct, args.seed) if fits(a)]
    answers = llm.chat([rendered(a) for a in asks],
                       [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=48,
                                       seed=args.seed * 7919 + i) for i in range(len(asks))],
                       progress=True) if asks else []
    questions = list(dict.fromkeys(q for a in answers
                                   if (q := P.question_from_answer(a.text)) is not None))

    made = P.make_prompts(args.seed) + [("self-instruct", q) for q in questions]
    # Mixed, so that a run cut short by --limit or --max-seconds still draws on every source.
    random.Random(args.seed).shuffle(made)
    kept = [(source, text) for source, text in made if not overlaps_heldout(text)]
    dropped = len(made) - len(kept)
    fit = [fits(text) for _, text in kept]
    kept = [prompt for prompt, ok in zip(kept, fit) if ok]
    if args.limit is not None:
        kept = kept[:args.limit]
    return {"settings": _settings(args), "sessions": 0, "prompts": [list(p) for p in kept],
            "answered": [], "answer_tokens": 0, "finish_reasons": {},
            "self_instruct": {"asked": len(asks), "usable_questions": len(questions),
                              "question_tokens": sum(len(a.token_ids) for a in answers)},
            "heldout_dropped": dropped, "too_long_dropped": fit.count(False), "files": []}
