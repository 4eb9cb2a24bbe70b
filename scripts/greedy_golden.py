"""Greedy continuations of an installed model by transformers' own GGUF loader, stored as data.

`python scripts/greedy_golden.py --model qwen2.5-coder-1.5b > tests/models/data/qwen2.5-coder-1.5b.json`
(needs the `parity` extra: torch, transformers). For each of 16 held-out requests (8 chat, 8
code: `specjax.analysis.heldout`), rendered with the model's chat template by specjax (the
same ids both sides), transformers' float32 forward of the dequantized file generates
`--tokens` greedy tokens or up to the end of its turn (the ids specjax stops at), and records
its top-2 logit margin at each:
tests/models/test_qwen2_5_coder.py compares the engine with them without running transformers,
which would cost the slow job minutes and 6 GB for the 1.5B. `--check FILE` runs specjax
instead (its default: weights kept quantized) on a stored file's requests and prints how many
continuations equal transformers', and each first difference with transformers' margin there.
"""
import argparse
import json
import sys

from specjax.analysis.heldout import CHAT, CODE
from specjax.chat import ChatTemplate
from specjax.models.registry import installed_model
from specjax.tokenizer import Tokenizer

REQUESTS = CHAT[:8] + CODE[:8]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="an installed model's name")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--check", default=None, help="a stored file: compare specjax with it")
    args = p.parse_args()
    if args.check:
        return check(args.model, json.loads(open(args.check).read()))
    import torch
    import transformers
    path = installed_model(args.model)
    tok = Tokenizer.from_model(path)
    template = ChatTemplate.from_tokenizer(tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = {"model": args.model, "file": path.name, "tokens": args.tokens,
           "transformers": transformers.__version__, "requests": []}
    for text in REQUESTS:
        ids = template.prompt_ids(tok, [{"role": "user", "content": text}])
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                              eos_token_id=list(tok.eos_token_ids), pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
        top = [torch.topk(s[0], 2).values for s in gen.scores]
        out["requests"].append({
            "prompt": text, "prompt_ids": ids,
            "greedy": gen.sequences[0, len(ids):].tolist(),
            "margins": [round(float(t[0] - t[1]), 4) for t in top]})
        print(f"{len(out['requests'])}/16", file=sys.stderr, flush=True)
    json.dump(out, sys.stdout, indent=1)
    print()


def check(model: str, golden: dict) -> None:
    import specjax
    llm = specjax.LLM(model, max_batch_size=16, batch_sizes=(16,), max_model_len=512,
                      progress=False)
    requests = golden["requests"]
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in requests],
                    specjax.SamplingParams(max_tokens=golden["tokens"], temperature=0))
    equal = 0
    for r, out in zip(requests, outs):
        at = next((i for i, (a, b) in enumerate(zip(out.token_ids, r["greedy"])) if a != b),
                  None)
        if at is None and len(out.token_ids) == len(r["greedy"]):
            equal += 1
        else:
            margin = r["margins"][at] if at is not None else float("nan")
            print(f"differs at token {at}: transformers' top-2 margin there {margin:.4f}: "
                  f"{r['prompt'][:50]!r}")
    print(f"{model}: {equal}/{len(requests)} greedy continuations x {golden['tokens']} tokens "
          f"equal transformers {golden['transformers']}'s")


if __name__ == "__main__":
    main()
