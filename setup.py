"""Builds verispec's C kernels (src/verispec/models/gguf/csrc) with the machine's compiler at install time.

The extension needs no torch headers (numpy arrays cross through ctypes), so pip's isolated build
environment needs only setuptools. SIMD paths are chosen at run time inside the library
(target attributes and CPU feature checks), so one build runs on AVX2-only and AVX-512 machines alike.
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "verispec.models.gguf._native",
            sources=["src/verispec/models/gguf/csrc/kernels.c"],
            # kernels.c includes the other files of csrc/ as one translation unit
            depends=sorted(glob("src/verispec/models/gguf/csrc/*.h")),
            # -ffp-contract=off: a multiply and an add stay two roundings unless the code asks for fmaf,
            # so every path (and the portable one on any compiler) computes the same float operations.
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
        )
    ]
)
