"""Drive specjax's jitted steps from your own loop: NGram and EAGLE-3 on the bundled model.

`specjax.LLM` wraps a host loop (scheduler, block allocator, overlap scheduler) around two pure
step functions from `specjax.core`. This script calls those steps by hand, with none of that
machinery, and checks that the greedy tokens match `LLM.generate` token for token (greedy
speculative decoding is exact, so both also equal plain greedy decoding).

    .venv/bin/python examples/custom_loop.py
"""
from __future__ import annotations

import sys

import numpy as np

import specjax
from specjax.core import (empty_batch, init_state, make_generation_step, make_prefill_step,
                          runs_on_device, set_row, split_model)
from specjax.models import load_hf_checkpoint
from specjax.models.registry import resolve_model_path
from specjax.tokenizer import Tokenizer

D = 4                  # max draft length: a generation step verifies up to D drafts per row
CHUNK = 64             # prefill run width; longer prompts take several prefill calls
TOKENS_PER_BLOCK = 16
PROMPTS = [            # the first is longer than one chunk, so it is prefilled in two calls
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __add__(self, other):\n        return Point(self.x + other.x, self.y + other.y)\n\n"
    "    def __sub__(self, other):\n",
    "def fibonacci(n):",
]


def run(target, prompts: list[list[int]], max_tokens: int, *, drafter=None, spec=None):
    """Greedy generation for `prompts` (one batch row and one slot each) -> (the new tokens of
    each prompt, tokens emitted per generation step and row). `drafter`: a host drafter whose
    drafts ride in the batch; `spec`: a `Speculation` whose worker drafts inside the steps."""
    worker = spec.worker if spec else None
    graphdef, params = split_model(target, spec.draft_model if spec else None)
    rows = len(prompts)
    max_lens = [len(p) + max_tokens for p in prompts]
    # No allocator: row i owns a fixed run of blocks big enough for its whole context plus
    # 2*D positions (a step writes K/V for the newest token and D drafts to verify and, with
    # an in-step drafter, D more for its own drafts). Block 0 is the null block.
    M = -(-(max(max_lens) + 2 * D) // TOKENS_PER_BLOCK)
    blocks = [list(range(1 + i * M, 1 + (i + 1) * M)) for i in range(rows)]
    state = init_state(target.config, num_slots=rows, num_blocks=1 + rows * M,
                       tokens_per_block=TOKENS_PER_BLOCK, max_draft_len=D, worker=worker)
    prefill, generate = make_prefill_step(graphdef, worker), make_generation_step(graphdef, worker)
    # Rows never passed to set_row stay padding: null blocks and the spare slot (= num_slots).
    new_batch = lambda width: empty_batch(rows, width, M, spare_slot=rows)

    # Prefill, chunk by chunk: each prompt advances CHUNK tokens per call, and a row whose
    # prompt is done stays padding. The token sampled after a prompt's last chunk is its first.
    tokens = [list(p) for p in prompts]
    for start in range(0, max(map(len, prompts)), CHUNK):
        batch = new_batch(CHUNK)
        for i, p in enumerate(prompts):
            if start < len(p):
                end = start + CHUNK
                # Hidden-state drafters (EAGLE-3) pair each position with the token after it,
                # so a chunk that does not end the prompt passes the next prompt token.
                set_row(batch, i, run=p[start:end], start_pos=start, blocks=blocks[i], slot=i,
                        max_len=max_lens[i], next_token=p[end] if end < len(p) else -1)
        state, out = prefill(params, state, batch)  # the state is donated: always rebind it
        for i, p in enumerate(prompts):
            if start < len(p) <= start + CHUNK:
                tokens[i].append(int(out.tokens[i]))

    # Generation: each step verifies [newest token, drafts] per row and emits the accepted
    # drafts plus one target token: 1..D+1 tokens per row. The width D+1 is the draft length
    # (one compiled program per width).
    device_runs = runs_on_device(worker, D)
    per_step = []
    while any(len(t) < n for t, n in zip(tokens, max_lens)):
        batch = new_batch(D + 1)
        for i, t in enumerate(tokens):
            room = max_lens[i] - len(t) - 1  # drafts that fit before max_len
            if room < 0:
                continue  # finished: the row stays padding
            if device_runs:
                # EAGLE-3's drafts exist only on the device: the step reads each row's run
                # (newest token + drafts, clipped to max_len) and its start from slot state.
                # The host only marks the row real; the drafts here are placeholders.
                drafts = [0] * min(D, room)
            else:
                # Host drafter: propose from the tokens so far; the drafts travel in the
                # batch. The step verifies none past max_len; asking for no more than fit
                # keeps the drafter from proposing what would be cut.
                drafts = drafter.propose(t, min(D, room))
            # The newest token sits at position len(t) - 1; its K/V is not in the pool yet.
            set_row(batch, i, run=[t[-1]] + drafts, start_pos=len(t) - 1, blocks=blocks[i],
                    slot=i, max_len=max_lens[i])
        state, out = generate(params, state, batch)
        new_tokens, lens = np.asarray(out.new_tokens), np.asarray(out.new_tokens_lens)
        for i in np.flatnonzero(batch.query_lens):  # real rows; padded rows' outputs are junk
            tokens[i] += new_tokens[i, :lens[i]].tolist()
            per_step.append(int(lens[i]))
    return [t[len(p):] for t, p in zip(tokens, prompts)], per_step


def main(max_tokens: int = 64, prompts: list[str] = PROMPTS) -> dict[str, dict]:
    """Both modes by hand, each checked against `LLM.generate` with the same config.
    -> {mode: {"al": tokens per generation step and row, "match": bool, "outputs": ids}}"""
    path = resolve_model_path("bundled")
    target = load_hf_checkpoint(path)
    tokenizer = Tokenizer.from_folder(path)
    ids = [tokenizer.encode(p, add_bos=True) for p in prompts]
    modes = {
        "ngram": specjax.NGramConfig(max_draft_len=D, max_matching_ngram_size=3),
        # The EAGLE-3 head trained for the bundled target ships with it.
        "eagle3": specjax.EagleConfig(max_draft_len=D, speculative_model="bundled-eagle3"),
    }
    results = {}
    for name, config in modes.items():
        if name == "ngram":  # a host drafter: no module in the steps
            how = dict(drafter=specjax.NGramDrafter(max_draft_len=D, max_matching_ngram_size=3))
        else:  # an in-step drafter: its worker, weights and KV pool ride in both steps
            how = dict(spec=specjax.build_speculation(config, target))
        outputs, per_step = run(target, ids, max_tokens, **how)

        # The reference: the engine over the same steps (it compiles only the shapes this
        # run uses).
        llm = specjax.LLM("bundled", speculative_config=config, max_batch_size=len(ids),
                          progress=False)
        params = specjax.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        expected = [list(o.token_ids) for o in llm.generate(ids, params)]
        al = sum(per_step) / len(per_step)
        results[name] = dict(al=al, match=outputs == expected, outputs=outputs)
        print(f"{name:6s}  tokens/AL {al:.2f} ({sum(per_step)} tokens in {len(per_step)} "
              f"row-steps)  matches LLM.generate: {outputs == expected}")
    print(f"{prompts[-1]!r} ->", repr(tokenizer.decode(results["eagle3"]["outputs"][-1])))
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["match"] for r in main().values()) else 1)
