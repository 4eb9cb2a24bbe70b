"""Builds the CPU matmul kernel (pallas_kernels/cpu_matmul/kernel.cc, and pack.cc: GGUF blocks
repacked for it at load) as part of `pip install`.

Everything else is in pyproject.toml. The extension is optional: without a C++ compiler (or on
a platform it does not build for) the install still succeeds, and the jnp dot runs instead
(`pallas_kernels.cpu_matmul.status()` says why). The XLA FFI headers are vendored under
pallas_kernels/cpu_matmul/include (from jaxlib 0.10.2; the FFI's C API is versioned, so a
handler built against them loads in later jaxlibs).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "pallas_kernels.cpu_matmul._kernel",
    sources=["pallas_kernels/cpu_matmul/kernel.cc", "pallas_kernels/cpu_matmul/pack.cc"],
    include_dirs=["pallas_kernels/cpu_matmul/include"],
    language="c++",
    # No -march: the kernel picks AVX-512 / AVX2 / portable code at run time.
    extra_compile_args=["-std=c++17", "-O3", "-Wno-attributes",
                        "-Wno-return-type"],
    optional=True,
)])
