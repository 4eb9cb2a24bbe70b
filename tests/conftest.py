"""Shared tiny models and warmed-up engines: compile once per session, not once per test."""
import atexit
import gc
import os
import shutil
import tempfile

import jax

from specjax.xla_flags import gpu_plugin_installed

# The suite compiles a few thousand programs of tiny models whose run time is negligible, so
# on a CPU it compiles them for compile speed: LLVM at -O0 and XLA:CPU's elemental emitters.
# Two tiny generation steps compile in 0.69 s against 2.22 s with XLA's defaults (the bundled
# model then decodes at 242 tok/s against 587; 2-core Intel Xeon). The programs compute the
# same functions; what specjax runs for users (and the benches time) keeps XLA's defaults.
# SPECJAX_TESTS_XLA_FLAGS replaces these (empty: XLA's defaults). Set before any backend
# starts, and inherited by the subprocesses the tests start.
TEST_XLA_FLAGS = os.environ.setdefault(
    "SPECJAX_TESTS_XLA_FLAGS",
    "" if gpu_plugin_installed() else
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] + [f for f in TEST_XLA_FLAGS.split()
                                         if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
).strip()

# The parity tests run transformers beside the engine in one process, and the xdist workers
# share the cores: torch's OpenMP threads spin-wait between ops by default and take the cores
# from XLA's pool and the other worker. Sleeping instead changes no result (only idle
# threads), and the Gemma 3 and SmolLM2 slow modules took 237 s against 300 (2-core Intel
# Xeon; the Gemma greedy test 112 s against 170). Set before torch loads libgomp, and
# inherited by the workers and subprocesses.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A persistent compilation cache of this test run's own, empty at its start and shared by its
# xdist workers and by every subprocess the tests start (servers, CLIs, notebooks: through
# SPECJAX_COMPILATION_CACHE); the first process to load this file makes it, the rest inherit
# the variable. Each module drops its compiled programs (below), and the next module that
# builds the same engine loads them from disk instead of compiling them again. Nothing from an
# earlier run is in it, and the compile counter counts a load as a compilation
# (tests/engine/test_compile_counter.py), so "no compiles after warm-up" still proves what it
# says. (tests/engine/test_compile_cache.py gives its subprocesses a cache of their own.)
if "SPECJAX_TESTS_JAX_CACHE" not in os.environ:
    os.environ["SPECJAX_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="specjax-tests-jax-")
    atexit.register(shutil.rmtree, os.environ["SPECJAX_TESTS_JAX_CACHE"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["SPECJAX_TESTS_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ["SPECJAX_COMPILATION_CACHE"] = os.environ["SPECJAX_TESTS_JAX_CACHE"]

import pytest
from flax import nnx

from specjax.models import Llama, ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                   eos_token_id=None)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. One pytest process compiles
    thousands of XLA:CPU executables; kept alive, their JIT code mappings grow until XLA aborts
    mid-compile (seen on the 2-core CI machine). Session fixtures recompile on next use."""
    yield
    from specjax.core.steps import make_generation_step, make_prefill_step
    make_prefill_step.cache_clear()
    make_generation_step.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model():
    return Llama(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    import specjax
    return specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                       max_prefill_rows=2, num_kv_blocks=80, progress=False, seed=0,
                       warmup=True)


@pytest.fixture(scope="session")
def fim_tokenizer():
    """The bundled tokenizer with Qwen2.5-Coder's FIM tokens (`tests/fim_tokens.py`)."""
    from tests.fim_tokens import added_special_tokenizer
    return added_special_tokenizer()


# Tiny Hugging Face checkpoints, one per supported family, each with its distinguishing
# feature switched on (llama3 RoPE scaling, Qwen2 q/k/v biases, Qwen3 q/k norm, tied
# embeddings, Mistral's sliding window shorter than the sequences).
HF_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_families(transformers):
    return {
        "llama3": (transformers.LlamaConfig, dict(
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16),
            tie_word_embeddings=False)),
        "qwen2_bias": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
        # Hybrid: Mamba-2 mixers around one attention layer (half-rotary RoPE); 2 B/C groups;
        # chunks of 4 so transformers' chunked scan crosses chunk boundaries.
        "bamba": (transformers.BambaConfig, dict(
            attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
            mamba_chunk_size=4, attention_bias=True, tie_word_embeddings=False)),
        "qwen3_qknorm_tied": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
        "mistral_window": (transformers.MistralConfig, dict(sliding_window=5, head_dim=8,
                                                            tie_word_embeddings=False)),
        # Gemma 3: local and global layers with their own RoPE bases (linear scaling on the
        # global one), a window shorter than the sequences, query_pre_attn_scalar != head_dim.
        "gemma3": (transformers.Gemma3TextConfig, dict(
            head_dim=8, sliding_window=5, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}},
            tie_word_embeddings=True)),
        "llama_tied_linear": (transformers.LlamaConfig, dict(
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
            tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    }


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name) -> (folder, transformers model), built once per session."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    families, cache = _hf_families(transformers), {}

    def build(name):
        if name not in cache:
            cfg_cls, extra = families[name]
            config = cfg_cls(**HF_COMMON, **extra)
            config._attn_implementation = "eager"
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(config).eval()
            # Fresh HF models have zero biases and unit norms, which would hide a skipped one.
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in hf.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            cache[name] = (folder, hf)
        return cache[name]

    return build
