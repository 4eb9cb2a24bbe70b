"""Training for the models specjax ships: `python -m specjax.train <subcommand> --help`.

- `target`: the bundled Llama-family target, trained on the Python standard library source.
- `draft`: a small draft model with the target's tokenizer and corpus (the target's recipe).
- `eagle3`, `mtp`: draft heads on a frozen target (`specjax.train.heads`).
- `eval`: held-out loss of an exported target checkpoint.

Every trainer shares the optimisation recipe (`config`), the work folder (`workdir`) and the
resumable training loop (`loop`).
"""
