"""The CRC-32 of a tensor's bytes (msprobe's ``md5`` field, the checklist's fingerprints), and the worker thread
that takes them from private copies of device tensors beside training.

A tensor is hashed in row-major order, as its contiguous copy would be, a piece at a time
(:func:`pytest_msprobe.dump.reductions.pieces`): a non-contiguous tensor, or one on a device, of any size adds at
most a piece's copy to the host's memory, never its whole contiguous copy.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pytest_msprobe.dump.ops import contiguous as _contiguous
from pytest_msprobe.dump.ops import detach as _detach
from pytest_msprobe.dump.ops import reshape as _reshape
from pytest_msprobe.dump.ops import view as _view_dtype
from pytest_msprobe.dump.reductions import pieces
from pytest_msprobe.format.crc import crc32


def crc32_hex(t: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes in row-major order, as 8 hex digits (msprobe's "md5" field); a tensor off the
    CPU is moved to the host a piece at a time."""
    data = _detach(t)
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    value = 0
    if data.numel():
        whole = data.is_contiguous() and data.device.type == "cpu"
        for piece in (data,) if whole else pieces(data):
            raw = _view_dtype(_reshape(_contiguous(piece), (-1,)), torch.uint8)
            value = crc32((raw if raw.device.type == "cpu" else raw.cpu()).numpy(), value)
    return f"{value & 0xFFFFFFFF:08x}"


_CRC_POOL: ThreadPoolExecutor | None = None


def crc_pool(worker_init: Callable[[], None] | None) -> ThreadPoolExecutor:
    """One worker thread per process for CRC32s: they run beside training on private copies."""
    global _CRC_POOL
    if _CRC_POOL is None:
        _CRC_POOL = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pytest-msprobe-crc", initializer=worker_init
        )
    return _CRC_POOL
