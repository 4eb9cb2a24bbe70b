"""Chain speculative sampling (rejection sampling of a chain of drafts).

`chain_speculative_sampling` is what callers use: the compiled Pallas kernel on a GPU, the jnp
reference elsewhere, the kernel in interpret mode with `interpret=True` (see
`pallas_kernels.backend`).
"""
from __future__ import annotations

import jax

from pallas_kernels.backend import dispatch
from pallas_kernels.rejection_sampling.kernel import chain_speculative_sampling_kernel
from pallas_kernels.rejection_sampling.reference import (bits_to_uniform,
                                                          chain_speculative_sampling_reference,
                                                          counter_bits, counter_uniform, mix32)


def chain_speculative_sampling(
        draft_probs: jax.Array, draft_token_ids: jax.Array, target_probs: jax.Array,
        seeds: jax.Array, offsets: jax.Array, draft_lens: jax.Array | None = None, *,
        interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """See `chain_speculative_sampling_reference` for the contract."""
    return dispatch(chain_speculative_sampling_kernel, chain_speculative_sampling_reference,
                    draft_probs, draft_token_ids, target_probs, seeds, offsets, draft_lens,
                    interpret=interpret)


__all__ = ["bits_to_uniform", "chain_speculative_sampling", "chain_speculative_sampling_kernel",
           "chain_speculative_sampling_reference", "counter_bits", "counter_uniform", "mix32"]
