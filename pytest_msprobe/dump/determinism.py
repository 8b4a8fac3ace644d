"""seed_all: the same seeding and deterministic switches as msprobe's, so seeded runs agree across the two tools.

What it sets, as msprobe does: ``random``, ``PYTHONHASHSEED``, numpy, torch (every device), and with
``mode=True`` ``torch.use_deterministic_algorithms(True)``. On CUDA: cuDNN deterministic and not benchmarking,
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (needed by deterministic cuBLAS from CUDA 10.2 on). On Ascend NPU (when
torch_npu is imported): the NPU generators, and with ``mode=True`` the HCCL/LCCL deterministic switches and
``CLOSE_MATMUL_K_SHIFT``. ``rm_dropout=True`` turns the dropout functions into identities (p = 0), msprobe's
way of taking dropout's randomness out of a comparison.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from collections.abc import Callable
from typing import Any

from pytest_msprobe.errors import ConfigError

_MAX_SEED = 2**32 - 1
# what mode=True sets on Ascend NPU
_NPU_DETERMINISTIC_ENV = {
    "HCCL_DETERMINISTIC": "True",
    "LCCL_DETERMINISTIC": "1",
    "CLOSE_MATMUL_K_SHIFT": "1",
    "ATB_LLM_LCOC_ENABLE": "0",
}
# every environment variable seed_all may set (a caller that must leave the environment as it found it saves these)
SEED_ENV: tuple[str, ...] = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", *_NPU_DETERMINISTIC_ENV)
_DROPOUT_FUNCTIONS = (
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
)
_LAST_SEED: list[int] = []  # the seed of the last seed_all in this process (the checklist records it)


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> None:
    """Seed every random generator and, with ``mode=True``, switch on deterministic algorithms.

    Example::

        seed_all(seed=1234, mode=True)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ConfigError(f"seed={seed!r}: expected an integer between 0 and 2**32 - 1")
    if not isinstance(mode, bool):
        raise ConfigError(f"mode={mode!r}: expected True or False")
    if not isinstance(rm_dropout, bool):
        raise ConfigError(f"rm_dropout={rm_dropout!r}: expected True or False")

    import numpy as np
    import torch

    _LAST_SEED[:] = [seed]
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    torch.use_deterministic_algorithms(mode)

    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        cuda_version = torch.version.cuda
        if cuda_version and _version_tuple(cuda_version) >= (10, 2):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    if npu is not None:
        npu.manual_seed_all(seed)
        if mode:
            os.environ.update(_NPU_DETERMINISTIC_ENV)

    if rm_dropout:
        _remove_dropout()


def last_seed() -> int | None:
    """The seed of the last :func:`seed_all` of this process (None before any)."""
    return _LAST_SEED[0] if _LAST_SEED else None


def dropout_removed() -> bool:
    """Whether ``seed_all(rm_dropout=True)`` made torch.nn.functional's dropouts identities."""
    import torch.nn.functional as F

    return bool(getattr(getattr(F, "dropout", None), "_msprobe_no_dropout", False))


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _remove_dropout() -> None:
    """Make torch.nn.functional's dropouts use p = 0 (idempotent)."""
    import torch.nn.functional as F

    for name in _DROPOUT_FUNCTIONS:
        original = getattr(F, name, None)
        if original is None or getattr(original, "_msprobe_no_dropout", False):
            continue
        setattr(F, name, _zero_p(original))


def _zero_p(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def no_dropout(input: Any, p: float = 0.5, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("p", None)
        return original(input, 0.0, *args, **kwargs)

    no_dropout._msprobe_no_dropout = True  # type: ignore[attr-defined]
    return no_dropout
