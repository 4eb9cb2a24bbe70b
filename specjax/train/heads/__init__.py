"""Train EAGLE-3 and MTP draft heads on a frozen target's hidden states.

`python -m specjax.train eagle3 --target DIR --out DIR` and `python -m specjax.train mtp ...`
(the subcommand modules `specjax.train.eagle3` / `specjax.train.mtp` add their flags and export
to the shared driver `cli`). The target is never trained: every batch runs its dense forward
inside the jitted step, capturing the residual streams the head reads, and its own next-token
distribution is the label (soft targets: distillation, not the corpus's next token).

Alignment. A training window holds tokens x[0..T] (T + 1 of them) and the target's outputs at
each of those rows. Head row t reads the hidden state at t and the embedding of token t+1 and
predicts token t+2: its label is the target's distribution at row t+1. Draft step j (1-based) of
anchor row t feeds the embedding of token t+j and is labelled with the target's distribution at
row t+j; it is masked when t+j runs off the window.

- `spec`: what is trained (HeadSpec, its HeadKind) and the head's warm-started initialisation.
- `kinds`: one HeadKind per kind of head (EAGLE-3, MTP, PARD, DFlash, DSpark): its checks,
  initialisation, drafts, loss, report and model card.
- `attention`, `chain`: the draft chain unrolled as the engine drafts it.
- `loss`: the soft cross-entropy over the chain's steps.
- `training`: the jitted step and validation, on the shared loop (`specjax.train.loop`).
- `report`: the exact greedy acceptance report.
- `data`: batches from the target's corpus or from saved hidden states.
- `cli`, `card`: the command-line driver, the export checks and the model card.
"""
# Every kind registers itself by name (`spec.KINDS`) before any HeadSpec is made.
from specjax.train.heads import kinds  # noqa: F401
