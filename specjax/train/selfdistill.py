"""Training data from the target itself: `python -m specjax.train data --target smollm2 --out
DIR`. Prompts made locally (`specjax.train.prompts`: the standard library's docstrings, a topic
list, self-instruct), rendered through the target's chat template and answered by the target
with the engine, batched; SAVE_HIDDEN_STATES writes the residual streams the heads train on
(`DIR/hidden`, read by `python -m specjax.train eagle3 | dflash --hidden-states DIR/hidden`).
Prompts sharing a 6-word run with the bench's held-out prompts are dropped.
`DIR/manifest.json` records the prompts' sources, the settings and what came out."""
from __future__ import annotations

import argparse
import json
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


def _params(i: int, temperature: float, max_tokens: int, seed: int):
    from specjax import SamplingParams
    if i % 2 == 0 or temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                          seed=seed * 1_000_003 + i)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from specjax import LLM, SamplingParams, SaveHiddenStatesConfig
    out: Path = args.out
    if (out / "hidden").exists() and any((out / "hidden").iterdir()):
        raise SystemExit(f"--out {out}: {out / 'hidden'} already holds files; pick a new folder")
    start = time.perf_counter()
    save = SaveHiddenStatesConfig(output_directory=str(out / "hidden"), layers=args.layers,
                                  write_interval=200)
    llm = LLM(args.target, dtype=args.dtype, max_batch_size=args.batch_size,
              speculative_config=save)
    layers = llm.engine.recorder.layers
    rendered = lambda text: [{"role": "user", "content": text}]

    # Self-instruct: the target writes questions, which join the prompts below.
    asks = P.question_requests(args.self_instruct, args.seed)
    answers = llm.chat([rendered(a) for a in asks],
                       [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=48,
                                       seed=args.seed * 7919 + i) for i in range(len(asks))],
                       progress=True) if asks else []
    questions = list(dict.fromkeys(q for a in answers
                                   if (q := P.question_from_answer(a.text)) is not None))

    made = P.make_prompts(args.seed) + [("self-instruct", q) for q in questions]
    kept = [(source, text) for source, text in made if not overlaps_heldout(text)]
    dropped = len(made) - len(kept)
    if args.limit is not None:
        kept = kept[:args.limit]
    outputs = llm.chat([rendered(text) for _, text in kept],
                       [_params(i, args.temperature, args.max_tokens, args.seed)
                        for i in range(len(kept))], progress=True)
    llm.engine.recorder.flush()
    llm.close()

    sources: dict[str, int] = {}
    for source, _ in kept:
        sources[source] = sources.get(source, 0) + 1
    answered = [len(o.token_ids) for o in outputs]
    manifest = {
        "target": str(args.target), "dtype": args.dtype, "layers": list(layers),
        "command": "python -m specjax.train data " + " ".join(argv[1:]),
        "prompts": len(kept), "sources": sources,
        "self_instruct": {"asked": len(asks), "usable_questions": len(questions),
                          "question_tokens": sum(len(a.token_ids) for a in answers)},
        "heldout_dropped": dropped,
        "heldout_rule": f"prompts sharing a {SPAN}-word run with specjax.analysis.heldout's "
                        "CHAT or CODE prompts are dropped",
        "sampling": {"greedy": "even-numbered prompts",
                     "temperature": args.temperature, "top_p": 0.95,
                     "max_tokens": args.max_tokens},
        "answer_tokens": sum(answered),
        "finish_reasons": {r: sum(o.finish_reason == r for o in outputs)
                           for r in {o.finish_reason for o in outputs}},
        "files": sorted(p.name for p in (out / "hidden").glob("*.safetensors")),
        "seconds": round(time.perf_counter() - start, 1),
        "prompt_texts": [{"source": s, "text": t} for s, t in kept],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(kept)} prompts ({dropped} dropped as held-out overlaps), {sum(answered):,} "
          f"answer tokens in {manifest['seconds']:.0f} s -> {out}", flush=True)
    return 0
