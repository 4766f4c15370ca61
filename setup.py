"""The one compiled part: damcha_torch._headmix (backends/torch/_headmix.c), a
plain C extension (Python's headers only, no torch headers) that fuses a
decoding step's cross-head map on the CPU. Everything else, the metadata
included, is in pyproject.toml. The extension is optional: where it cannot
be built (no C compiler) the install goes on and damcha_torch computes the
same step with torch ops (damcha_torch.has_decode_kernel() says which; docs/torch.md,
"Incremental decoding")."""

from __future__ import annotations

import sys

from setuptools import Extension, setup

# -fopenmp-simd: the kernel's `omp simd` loops may reorder their sums (as a
# BLAS does) without the OpenMP runtime or -ffast-math, which would assume no
# NaN and break the NaN propagation the spec requires.
FLAGS = [] if sys.platform == "win32" else ["-O3", "-fopenmp-simd", "-std=gnu11"]

setup(
    ext_modules=[
        Extension("damcha_torch._headmix", ["backends/torch/_headmix.c"], extra_compile_args=FLAGS, optional=True)
    ]
)
