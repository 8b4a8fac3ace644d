"""CPU kernels pinned, so that a run on any x86-64 CPU matches the example's baseline within the thresholds:
the vector width of torch's kernels and MKL's code path by processor, and the number of threads (how reductions
are split).
The reasons and the measurements are in ``examples/resnet50/conftest.py``; nothing here touches a GPU's kernels.
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

    torch.set_num_threads(THREADS)
    torch.backends.mkldnn.enabled = False  # oneDNN picks its kernels by processor
