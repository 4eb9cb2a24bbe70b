"""What an engine is built with (`EngineConfig`: static sizing, every compiled shape follows
from it), what a hybrid target changes of it, and what the engine reports (`EngineSnapshot`)."""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
from jax.sharding import Mesh

from pallas_kernels import cpu_matmul

from specjax.core.recurrent import check_commit_mode
from specjax.core.sharding import TP, TensorParallel, make_mesh
from specjax.models.config import ModelConfig
from specjax.engine.scheduler import kv_reserve

log = logging.getLogger("specjax.engine")


def for_model(config: EngineConfig, mc: ModelConfig
              ) -> tuple[EngineConfig, TensorParallel | None, int]:
    """`config` checked against the model it serves -> (the config a hybrid target changes,
    the mesh or None, the longest request)."""
    tp = config.tensor_parallel()
    if tp is not None:
        tp.check(mc)
    if mc.is_hybrid:
        config = hybrid_engine_config(config, tp)
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    if any(local_kv_layers(config, mc, tp, max_len)) and config.enable_prefix_cache:
        log.info("prefix cache off: local layers keep only their window, which cached blocks "
                 "do not hold")
        config = dataclasses.replace(config, enable_prefix_cache=False)
    return config, tp, max_len


def local_kv_layers(config: EngineConfig, mc: ModelConfig, tp, max_len: int
                    ) -> tuple[bool, ...]:
    """Per attention layer, whether it keeps only its window's K/V (a ring per slot,
    `specjax.core.kv`): a sliding-window layer whose window is shorter than the longest
    request, with `local_kv` on, the layers unrolled (a ring is picked per layer while the
    step is traced), one device, a pure-attention target. () where no layer does."""
    if (not config.local_kv or tp is not None or mc.is_hybrid or config.layers_scanned()
            or not mc.sliding_windows):
        return ()
    flags = tuple(mc.sliding_windows[i] is not None and mc.sliding_windows[i] < max_len
                  for i in mc.kv_layers)
    return flags if any(flags) else ()


def ring_blocks(config: EngineConfig, mc: ModelConfig, widest_run: int) -> int:
    """Blocks a slot's ring holds: the widest window plus the widest run a step writes
    (`specjax.core.kv` says why that suffices), plus one for a run that starts mid-block."""
    window = max(w for w in mc.sliding_windows if w is not None)
    return -(-(window + widest_run) // config.tokens_per_block) + 1


def hybrid_engine_config(config: EngineConfig, tp) -> EngineConfig:
    """What a hybrid (recurrent-layer) target changes: no prefix cache -- cached K/V blocks
    cannot give back the recurrent state after them, so a request reading them would start
    its mixers from the wrong state -- and no tensor parallelism (no split plan for mixers)."""
    if tp is not None:
        raise ValueError("tensor parallelism does not support hybrid (Mamba) targets yet: "
                         "use tensor_parallel_size=1")
    if config.enable_prefix_cache:
        log.info("prefix cache off: a hybrid target's recurrent state cannot be rebuilt from "
                 "cached K/V blocks")
    return dataclasses.replace(config, enable_prefix_cache=False)


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit`."""
    buckets, b = [], 1
    while b < limit:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [limit])


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


# The default pool's room per request: what most requests use, not what one may reach.
TYPICAL_CONTEXT = 2048


def free_memory(device=None) -> int | None:
    """Bytes free on `device` (default: JAX's first) now: an accelerator's allocator limit
    less what it holds, the host's available memory for the CPU; None when nothing says."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    # MemAvailable counts the page cache the kernel would give back; "free" pages alone
    # (SC_AVPHYS_PAGES) can be a small part of that after large files were read (a model).
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # neither Linux nor POSIX sysconf
        return None


def kv_sizing(config: EngineConfig, speculation, max_len: int, mc: ModelConfig | None = None,
              free: int | None = None, tp: TensorParallel | None = None) -> tuple[int, int]:
    """(blocks per request, blocks in the pool).

    A request's ledger reaches its context plus what a generation step may reserve past its
    newest token. The pool, unless `num_kv_blocks` says: room for `max_batch_size` requests of
    min(max_model_len, TYPICAL_CONTEXT) tokens, at most `kv_memory_fraction` of the memory
    `free` now (counting the target `mc`'s pool on the plan `tp` that `for_model` made:
    drafters' are small beside it), never less than one request of max_model_len; plus the
    null block. Requests that outgrow it wait or are preempted (recomputed later), never
    lost: a model whose maximum is 8192 does not hold max_batch_size x 8192 tokens of K/V for
    the rare request that reaches it."""
    D = speculation.max_draft_len
    reserve = kv_reserve(D, speculation.drafts_in_step, speculation.verify_len(D))
    blocks_per_seq = -(-(max_len - 1 + reserve) // config.tokens_per_block)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
        if num_blocks - 1 < blocks_per_seq:
            raise ValueError(f"num_kv_blocks {num_blocks} cannot hold one request of "
                             f"max_model_len {max_len} ({blocks_per_seq} blocks + null)")
        return blocks_per_seq, num_blocks
    typical = -(-(min(max_len, TYPICAL_CONTEXT) - 1 + reserve) // config.tokens_per_block)
    wanted = config.max_batch_size * typical
    if mc is not None and free is not None:
        local = local_kv_layers(config, mc, tp, max_len)
        pooled = len(mc.kv_layers) - sum(local)  # the layers whose K/V the blocks hold
        block_bytes = max(1, config.tokens_per_block * mc.kv_bytes_per_token * pooled
                          // len(mc.kv_layers))
        wanted = min(wanted, int(free * config.kv_memory_fraction) // block_bytes)
    return blocks_per_seq, max(wanted, blocks_per_seq) + 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine sizing; every compiled shape follows from it."""

    max_batch_size: int = 8
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    tokens_per_block: int = 16
    num_kv_blocks: int | None = None    # default: `kv_sizing`'s rule
    kv_memory_fraction: float = 0.5     # the default pool's cap: this share of free memory
    prefill_chunk: int = 64             # run width of prompt-chunk steps
    max_prefill_rows: int = 2           # per-step prompt token budget = chunk x rows
    # The batch sizes generation steps compile for (CUDA-graph capture sizes in TensorRT-LLM):
    # a batch runs padded to the smallest one that holds it. Default: 1, 2, 4, ... and
    # max_batch_size. Fewer sizes, fewer programs to compile; more padding in small batches.
    batch_sizes: tuple[int, ...] | None = None
    # Dispatch step N+1 before reading step N, in modes whose next inputs stay on device.
    overlap_scheduler: bool = True
    # Share full KV blocks of committed tokens between requests with a common prefix
    # (`specjax.engine.prefix_cache`).
    enable_prefix_cache: bool = True
    # Tensor parallelism (`specjax.core.sharding`): the target split over this many devices,
    # or over `mesh`'s "tp" axis (a user-built Mesh; then its size decides).
    tensor_parallel_size: int = 1
    mesh: Mesh | None = None
    # Hybrid targets: how a verify step commits the recurrent state at the accepted depth,
    # "replay" (re-scan the accepted inputs) or "states" (keep every position's); see
    # `specjax.core.recurrent` for what each costs.
    recurrent_commit: str = "replay"
    # Run the target's layers under `lax.scan` (one layer body per compiled program) or
    # unrolled (L copies: warm-up about 20% longer on the bundled model; see
    # `specjax.models.llama`). None: unrolled on CPU, where XLA copies each scanned layer's
    # weights out of the stack before its matmuls, so a memory-bound step reads every weight
    # twice (`python -m specjax.bench xla`); scanned on accelerators.
    scan_layers: bool | None = None
    # Dense projections on a CPU: "kernel" runs `pallas_kernels.cpu_matmul` (each float32
    # weight packed once at load, then read once per step however many rows the step
    # verifies), "xla" XLA's dot. None: the kernel wherever it is built and the steps run on
    # one CPU device; XLA's dot elsewhere (accelerators, tensor parallelism).
    cpu_matmul: str | None = None
    # Sliding-window layers keep only their window's K/V, a ring per slot, where the layers
    # run unrolled on one device (`local_kv_layers`); the prefix cache is then off.
    local_kv: bool = True

    def __post_init__(self):
        if self.cpu_matmul not in (None, "kernel", "xla"):
            raise ValueError(f"cpu_matmul must be 'kernel', 'xla' or None (automatic), got "
                             f"{self.cpu_matmul!r}")
        if self.cpu_matmul == "kernel" and (self.tensor_parallel_size > 1
                                            or self.mesh is not None):
            raise ValueError("cpu_matmul='kernel' runs on one CPU device; tensor parallelism "
                             "keeps XLA's dot (leave cpu_matmul unset)")
        if self.cpu_matmul == "kernel" and not cpu_matmul.available():
            raise ValueError(f"cpu_matmul='kernel' but the CPU kernel cannot run here: "
                             f"{cpu_matmul.status()}")
        for name in ("max_batch_size", "tokens_per_block", "prefill_chunk", "max_prefill_rows",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 2):
                raise ValueError(f"{name} must be an int >= 2, got {value!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got "
                             f"{self.kv_memory_fraction!r}")
        check_commit_mode(self.recurrent_commit)
        sizes = self.batch_sizes
        if sizes is not None and (
                not isinstance(sizes, tuple) or not sizes
                or not all(isinstance(b, int) and 1 <= b <= self.max_batch_size for b in sizes)
                or list(sizes) != sorted(set(sizes)) or sizes[-1] != self.max_batch_size):
            raise ValueError(f"batch_sizes must be increasing ints in 1..max_batch_size, ending "
                             f"at max_batch_size ({self.max_batch_size}); got {sizes!r}")

        if self.mesh is not None and self.tensor_parallel_size not in (1, self.mesh.shape.get(
                TP, 0)):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} disagrees with "
                             f"the mesh's {TP!r} axis ({dict(self.mesh.shape)}); pass one")

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        return self.batch_sizes or power_of_two_buckets(self.max_batch_size)

    def layers_scanned(self) -> bool:
        """Whether the steps run the target's layers under `lax.scan` (`scan_layers`)."""
        if self.scan_layers is not None:
            return self.scan_layers
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        return next(iter(devices)).platform != "cpu"

    def matmul_path(self) -> str:
        """Which matmul the steps' dense projections run: "kernel (<instruction set>)" (the
        CPU kernel, weights packed at load) or "xla (<why>)"."""
        if self.cpu_matmul == "xla":
            return "xla (cpu_matmul='xla')"
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        platform = next(iter(devices)).platform
        if platform != "cpu":
            return f"xla ({platform})"
        if self.tensor_parallel_size > 1 or self.mesh is not None:
            return "xla (tensor parallelism)"
        return cpu_matmul.status()

    def packs_weights(self) -> bool:
        """Whether the steps run packed weights through the CPU kernel (`matmul_path`)."""
        return self.matmul_path().startswith("kernel")

    def tensor_parallel(self) -> TensorParallel | None:
        """The mesh the steps run on; None for one device."""
        if self.mesh is not None:
            return TensorParallel(self.mesh)
        if self.tensor_parallel_size > 1:
            return TensorParallel(make_mesh(self.tensor_parallel_size))
        return None


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's figures at one moment: what a server's metrics and health read, taken on
    the engine's own thread so no other thread reads its mutable state."""

    running: int = 0
    waiting: int = 0
    running_ids: tuple[int, ...] = ()
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_failed_requests: int = 0
    prefix_cache_hit_rate: float | None = None
    prefix_cache_blocks: int = 0
    acceptance_length: float | None = None
    acceptance_rate: float | None = None
    acceptance_per_position: tuple[float, ...] = ()
    draft_overhead: float | None = None
    proposed_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    draft_len_histogram: tuple[int, ...] = ()
    step_costs: tuple[tuple[tuple[int, int], float], ...] = ()   # ((bucket, width), seconds)

    @classmethod
    def of(cls, stats, scheduler, allocator, num_steps: int) -> EngineSnapshot:
        running = scheduler.running
        return cls(
            running=len(running), waiting=len(scheduler.waiting),
            running_ids=tuple(r.request_id for r in running),
            kv_blocks_free=allocator.num_free_blocks, kv_blocks_total=allocator.total_blocks,
            num_steps=num_steps, num_generated_tokens=stats.num_generated_tokens,
            num_preemptions=stats.num_preemptions, num_failed_requests=stats.num_failed_requests,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            prefix_cache_blocks=allocator.num_cached_blocks,
            acceptance_length=stats.acceptance_length, acceptance_rate=stats.acceptance_rate,
            acceptance_per_position=tuple(stats.acceptance_per_position),
            draft_overhead=stats.draft_overhead, proposed_tokens=stats.proposed_tokens,
            verified_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_draft_tokens,
            draft_len_histogram=tuple(stats.draft_len_histogram),
            step_costs=() if stats.step_costs is None
            else tuple(sorted(stats.step_costs.seconds.items())))
