"""GPU kernels for specjax's hot spots, each beside a plain-jnp reference with the same signature.

Kernels arrive with the Pallas issue; callers go through this package's dispatch layer so the
Pallas backend (Triton today, Mosaic GPU on Hopper) can change without touching them.
"""
