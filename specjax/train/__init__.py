"""Training for the models specjax ships: `python -m specjax.train <subcommand> --help`.

- `target`: the bundled Llama-family target, trained on the Python standard library source.
- `eval`: held-out loss of an exported target checkpoint.
"""
