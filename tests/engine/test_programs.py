"""Compiled programs (`specjax.engine.programs`): each compiled once whoever needs it first,
a caller that needs one under way waits for it, background compiles start only while idle;
and an engine warmed up in the background serves exactly meanwhile, compiles nothing twice,
and measures its step costs once everything is compiled."""
import collections
import threading
import time

import pytest

import specjax
from specjax import NGramConfig, SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.engine.programs import Programs


class Compiler:
    """A stand-in compile: counts calls per key; `hold` blocks it until released."""

    def __init__(self):
        self.calls = collections.Counter()
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail = set()

    def __call__(self, key):
        self.calls[key] += 1
        self.started.set()
        assert self.release.wait(10)
        if key in self.fail:
            raise RuntimeError(f"cannot compile {key}")


def test_a_program_is_compiled_once_and_a_second_caller_waits_for_it():
    compiler = Compiler()
    programs = Programs(compiler)
    compiler.release.clear()
    first = threading.Thread(target=programs.ensure, args=("a",))
    first.start()
    assert compiler.started.wait(10)
    waited = []
    second = threading.Thread(target=lambda: (programs.ensure("a"), waited.append(True)))
    second.start()
    time.sleep(0.2)
    assert not waited and not programs.ready("a")      # still compiling: the caller waits
    compiler.release.set()
    first.join(10), second.join(10)
    assert waited and programs.ready("a")
    programs.ensure("a")
    assert compiler.calls == {"a": 1}


def test_a_failed_compile_raises_in_every_caller_and_is_tried_again():
    compiler = Compiler()
    compiler.fail.add("bad")
    programs = Programs(compiler)
    with pytest.raises(RuntimeError, match="cannot compile"):
        programs.ensure("bad")
    assert not programs.ready("bad")
    compiler.fail.clear()
    programs.ensure("bad")
    assert programs.ready("bad") and compiler.calls["bad"] == 2


def test_the_background_starts_compiles_only_while_idle():
    compiler = Compiler()
    programs = Programs(compiler)
    programs.idle.clear()                      # a request is in hand
    programs.start(["a", "b"])
    time.sleep(0.3)
    assert compiler.calls == {} and programs.compiling
    programs.ensure("b")                       # the request needs b: compiled now, here
    programs.idle.set()
    assert programs.wait(10)
    assert compiler.calls == {"a": 1, "b": 1}  # the background skipped what was done
    assert programs.pending == 0


@pytest.fixture(scope="module")
def plain_reference(tiny_model):
    llm = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                      max_prefill_rows=2, num_kv_blocks=80, progress=False, seed=0)
    return llm.generate(PROMPTS, SamplingParams(max_tokens=12))


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9], [4, 3, 2, 1, 4, 3]]


def test_a_background_warm_up_serves_exactly_meanwhile_and_compiles_nothing_twice(
        tiny_model, plain_reference):
    llm = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                      max_prefill_rows=2, num_kv_blocks=80, progress=False, seed=0,
                      speculative_config=NGramConfig(max_draft_len=3))
    engine = llm.engine
    compiles = collections.Counter()
    compile_one = engine.executor.programs._compile
    engine.executor.programs._compile = lambda key: (compiles.update([key]), compile_one(key))
    keys = engine.executor.program_keys(engine.generation_shapes())
    assert len(keys) == len(set(keys)) > 12      # every candidate length in every bucket
    llm.warmup(background=True)
    assert engine.length_policy.costs.seconds == {}
    outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12))   # while it compiles
    assert outs[0].token_ids == plain_reference[0].token_ids
    engine.executor.programs.wait(120)
    while engine.background_work(idle=True):   # what the server's engine thread does
        time.sleep(0.05)
    assert set(compiles) == set(keys) and max(compiles.values()) == 1
    # The cost model's table: every generation shape, measured once everything compiled.
    assert set(engine.length_policy.costs.seconds) == set(engine.generation_shapes())
    with count_compilations() as compiled:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12))
        assert compiled() == 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain_reference]
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
