"""CPU kernels pinned, so that the baseline shipped with the example holds on any x86-64 CPU.

A random-weight ResNet50 on a batch of 4 is chaotic: its BatchNorm layers (2x2 feature maps in the last stage)
turn rounding-level differences into errors far beyond float32's tolerance within two steps. The CPU's own
choices make such differences: the number of threads (how reductions are split), the vector width of torch's
kernels (AVX2 or AVX-512) and oneDNN's and MKL's kernels picked for the processor. Measured on one machine
against a baseline made on it: 1 thread instead of 2 breaches 1592 of 1939 calls, AVX2 kernels instead of
AVX-512 663, oneDNN limited to AVX2 1637, an AMD processor instead of an Intel one 1595 (MKL honours
MKL_CBWR=AVX2 on Intel processors only: on others it reports CNR:AUTO under MKL_VERBOSE=1 and picks its own
kernels, so the vendor-neutral COMPATIBLE path is pinned). With the settings below every one of those runs matches
the baseline within the thresholds, though not byte for byte (on an AMD EPYC 21 Mean values differ by up to 8.9e-10).
They cost nothing on a GPU or NPU runner (the device's kernels are not affected) and are set before torch runs its
first kernel.
"""

from __future__ import annotations

import os
import platform

THREADS = 2

if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"  # torch's own kernels: the AVX2 code on every x86-64 CPU
    os.environ["MKL_CBWR"] = "COMPATIBLE"  # MKL's matrix products: one code path on Intel and AMD alike


def pytest_configure() -> None:
    import torch

    torch.set_num_threads(THREADS)  # reductions split the same way on any number of cores
    torch.backends.mkldnn.enabled = False  # oneDNN picks its convolution kernels by processor
