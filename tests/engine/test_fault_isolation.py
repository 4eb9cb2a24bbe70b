"""Chaos: a fault injected into one request's work fails that request alone.

Each test runs the same batch clean and with a fault planted in one request (marked by its
seed or its first prompt token): that request finishes with finish_reason "error" and a
message saying where it failed; every other request's tokens equal the clean run's; every KV
block comes back. A failure of the device step itself fails the requests holding K/V on the
device and nothing else: waiting requests, and requests sent afterwards, are served exactly.
"""
import pytest

import specjax
from specjax import SamplingParams
from specjax.engine import executor as executor_module
from specjax.engine.bookkeeper import Bookkeeper
from specjax.models.dense_greedy import dense_greedy

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7], [9, 9, 9, 9, 9], [3, 3],
           [60, 1, 60, 2, 60], [11, 12, 11, 12], [20, 21, 22]]
MAX_TOKENS = 10
MARK = 777  # the seed of the request a fault is planted in (greedy: the seed changes nothing)
VICTIM = 3


@pytest.fixture(scope="module")
def references(tiny_model):
    return [dense_greedy(tiny_model, p, MAX_TOKENS) for p in PROMPTS]


def _params(marked: int | None = VICTIM) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS, seed=MARK if i == marked else i)
            for i in range(len(PROMPTS))]


def _generate(llm, prompts, params):
    """Outputs, and the engine's failed-request count before they ran."""
    before = llm.engine.snapshot().num_failed_requests
    return llm.generate(prompts, params), before


def _check_isolated(llm, outs, references, victim: int, where: str,
                    failed_before: int) -> None:
    for i, out in enumerate(outs):
        if i == victim:
            assert out.finish_reason == "error" and where in out.error, out.error
        else:
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == references[i], i
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    assert engine.snapshot().num_failed_requests == failed_before + 1


def _fault_in_set_run(monkeypatch, phase: str) -> None:
    """The marked request's run raises while it is written into a step's batch, in the given
    phase."""
    real = executor_module.set_run

    def set_run(batch, row, **kw):
        generating = kw["start_pos"] >= len(PROMPTS[VICTIM])
        if batch.seeds[row] == MARK and generating == (phase == "generation"):
            # Written part-way, pointing at another request's slot: unless the row goes back
            # to padding, the step would run it and overwrite that request's slot state.
            real(batch, row, **kw)
            batch.slots[row] = 0
            raise OverflowError("planted")
        real(batch, row, **kw)

    monkeypatch.setattr(executor_module, "set_run", set_run)


def _fault_in_set_request(monkeypatch) -> None:
    """The marked request's row of the host's slot table raises while it is written (its
    first step, a prompt chunk)."""
    real = executor_module.set_request

    def set_request(table, row, **kw):
        if kw["seed"] == MARK:
            real(table, row, **{**kw, "slot": 0})   # half-written, pointing at slot 0
            raise OverflowError("planted")
        real(table, row, **kw)

    monkeypatch.setattr(executor_module, "set_request", set_request)


@pytest.mark.parametrize("where,phase", [("run", "prompt-chunk"), ("run", "generation"),
                                         ("request", "prompt-chunk")])
def test_a_row_that_cannot_be_prepared_fails_its_request_alone(tiny_llm, references,
                                                                monkeypatch, where, phase):
    if where == "run":
        _fault_in_set_run(monkeypatch, phase)
    else:
        _fault_in_set_request(monkeypatch)
    outs, before = _generate(tiny_llm, PROMPTS, _params())
    _check_isolated(tiny_llm, outs, references, VICTIM, f"preparing its {phase} row", before)


def test_a_ledger_fault_fails_its_request_alone(tiny_llm, references, monkeypatch):
    """Settling a generation step (read one call late, under the overlap scheduler)."""
    real = Bookkeeper._give_back
    calls = {"n": 0}

    def give_back(self, request, *args):
        if request.params.seed == MARK:
            calls["n"] += 1
            if calls["n"] == 3:
                raise AssertionError("planted")
        return real(self, request, *args)

    monkeypatch.setattr(Bookkeeper, "_give_back", give_back)
    outs, before = _generate(tiny_llm, PROMPTS, _params())
    _check_isolated(tiny_llm, outs, references, VICTIM, "settling its generation step", before)
    assert len(outs[VICTIM].token_ids) == 3  # the prompt's token and two generation steps


def test_a_device_fault_fails_only_requests_on_the_device(tiny_llm, references, monkeypatch):
    """The 4 running requests fail with the step; the 4 waiting ones, and a batch sent after,
    are exact: the engine went on with a fresh device state."""
    engine = tiny_llm.engine
    real, calls = engine.executor.steps["generation"], {"n": 0}

    def generation_step(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("planted device fault")
        return real(*args)

    monkeypatch.setitem(engine.executor.steps, "generation", generation_step)
    outs = tiny_llm.generate(PROMPTS, _params(marked=None))
    failed = [i for i, out in enumerate(outs) if out.finish_reason == "error"]
    assert failed == [0, 1, 2, 3]  # the first max_batch_size admitted
    assert all("the device step failed: RuntimeError: planted" in outs[i].error for i in failed)
    for i in range(4, len(PROMPTS)):
        assert outs[i].token_ids == references[i]
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    again = tiny_llm.generate(PROMPTS, _params(marked=None))
    assert [out.token_ids for out in again] == references


class Echo(specjax.Drafter):
    """Drafts the last tokens again (accepted whenever the model repeats itself); misbehaves
    for prompts that start with a marker token."""

    def propose(self, token_ids, max_draft_len):
        if token_ids[0] == 61:
            raise ValueError("planted drafter fault")
        if token_ids[0] == 62:
            return [64] * max_draft_len  # outside the vocabulary of 64
        return list(token_ids[-max_draft_len:])


@pytest.fixture(scope="module")
def echo_llm(tiny_model):
    return specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                       num_kv_blocks=80, progress=False, seed=0,
                       speculative_config=specjax.UserProvidedConfig(max_draft_len=3,
                                                                     drafter=Echo()))


@pytest.mark.parametrize("marker, where", [
    (61, "drafting for it: ValueError: planted drafter fault"),
    (62, "drafting for it: InvalidArgument: the drafter proposed token id 64, outside the "
         "vocabulary [0, 64)")])
def test_a_drafter_fault_fails_its_request_alone(echo_llm, tiny_model, references, marker,
                                                 where):
    prompts = [list(p) for p in PROMPTS]
    prompts[VICTIM] = [marker] + prompts[VICTIM]
    outs, before = _generate(echo_llm, prompts, _params(marked=None))
    _check_isolated(echo_llm, outs, references, VICTIM, where, before)
    accepted = sum(out.stats.num_accepted_draft_tokens for out in outs)
    assert 0 < accepted < sum(out.stats.num_draft_tokens for out in outs)  # mixed acceptance
