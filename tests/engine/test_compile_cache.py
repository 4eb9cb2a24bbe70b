"""The persistent compilation cache: a second process with the same model and sizes loads its
compiled steps from the cache folder instead of compiling them."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from specjax.engine import compile_cache
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]

# Builds the same tiny model, warms an LLM up and reports JAX's cache hits and misses.
SCRIPT = """
import json, sys
from jax import monitoring
counts = {"hits": 0, "misses": 0}
def listen(event, **_):
    if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
monitoring.register_event_listener(listen)
from flax import nnx
import specjax
from specjax.models import Llama, ModelConfig
TINY = ModelConfig(**json.loads(sys.argv[1]))
llm = specjax.LLM(Llama(TINY, rngs=nnx.Rngs(0)), max_batch_size=2, tokens_per_block=4,
                  prefill_chunk=8, progress=False, warmup=True)
tokens = llm.generate([1, 2, 3], specjax.SamplingParams(max_tokens=6))[0].token_ids
print(json.dumps({**counts, "tokens": tokens}))
"""


def _run(env):
    config = json.dumps(dataclasses.asdict(TINY))
    out = subprocess.run([sys.executable, "-c", SCRIPT, config], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_loads_compiled_steps_from_the_cache(tmp_path):
    env = {**os.environ, "SPECJAX_COMPILATION_CACHE": str(tmp_path / "cache"),
           "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    first = _run(env)
    assert first["misses"] > 0 and first["hits"] == 0
    assert any((tmp_path / "cache").iterdir())
    second = _run(env)
    # Every step the first start compiled is now a cache hit; none compiles again.
    assert second["hits"] >= first["misses"] and second["misses"] == 0
    assert second["tokens"] == first["tokens"]


def test_cache_folder_follows_the_environment(tmp_path):
    assert compile_cache.cache_dir({"SPECJAX_COMPILATION_CACHE": "off"}) is None
    assert compile_cache.cache_dir({"SPECJAX_COMPILATION_CACHE": str(tmp_path)}) == tmp_path
    assert compile_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == \
        tmp_path / "specjax" / "jax"
