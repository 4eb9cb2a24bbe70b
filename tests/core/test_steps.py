"""The compiled steps' cache: what `SPECJAX_PALLAS` forces is part of what a step depends on,
so a step traced under one kernel choice is never reused under another."""
from specjax.core.batch import empty_batch
from specjax.core.state import init_state, split_model
from specjax.core.steps import make_generation_step, make_prefill_step
from pallas_kernels import backend
from tests.conftest import TINY


def test_a_step_made_under_one_kernel_choice_is_not_reused_under_another(monkeypatch,
                                                                         tiny_model):
    graphdef, params = split_model(tiny_model)
    made = {}
    for forced in ("reference", "interpret", None):
        if forced is None:
            monkeypatch.delenv("SPECJAX_PALLAS", raising=False)
        else:
            monkeypatch.setenv("SPECJAX_PALLAS", forced)
        made[forced] = (make_prefill_step(graphdef), make_generation_step(graphdef))
        assert made[forced] == (make_prefill_step(graphdef), make_generation_step(graphdef))
    steps = [step for pair in made.values() for step in pair]
    assert len({id(step) for step in steps}) == len(steps)

    # Each traces under the choice it was made with, whatever the environment says then.
    chosen = []
    choose = backend.choose
    monkeypatch.setattr(backend, "choose",
                        lambda *args, **kwargs: chosen.append(choose(*args, **kwargs))
                        or chosen[-1])
    monkeypatch.setenv("SPECJAX_PALLAS", "interpret")
    state = init_state(TINY, num_slots=2, num_blocks=8, tokens_per_block=4)
    made["reference"][1].lower(params, state, empty_batch(2, 1, 4, 2))
    assert chosen and set(chosen) == {"reference"}, chosen
