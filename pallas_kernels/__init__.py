"""GPU kernels for specjax's hot spots, each beside a plain-jnp reference with the same signature.

- `pallas_kernels.rejection_sampling.chain_speculative_sampling`
- `pallas_kernels.paged_attention.paged_attention`
- `pallas_kernels.kv_gather.relocate_kv`, `pallas_kernels.kv_gather.gather_kv_pages`
- `pallas_kernels.ssm_scan.ssm_scan` (Mamba-2 chunked scan, for hybrid targets)

Each public name goes through `pallas_kernels.backend.dispatch`: the compiled Pallas kernel on
a GPU, the jnp reference on CPU/other backends, the kernel in interpret mode with
`interpret=True`. The Pallas GPU lowering (Triton today, Mosaic GPU later) is chosen in
`pallas_kernels.backend` only, so it can change without touching callers. See README.md here.
"""
