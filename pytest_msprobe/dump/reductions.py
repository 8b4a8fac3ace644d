"""The statistics of one tensor, reduced on its device as msprobe computes them, with no host sync: how a dtype's
statistics are taken (its kind), and max, min, sum and 2-norm accumulated accurately at any size.

Accurate at any size: a float32 sum of values that cancel (a gradient, a normalised activation) loses digits at
any size (1 in 10 random zero-mean tensors' means were more than 1e-6 off their float64 value), so sums
accumulate in float64 on the CPU and on CUDA. A norm adds squares, which never cancel, but one float32
accumulation drifts with the number of terms (torch's CPU norm of 1M float32 elements was 4e-4 off, of 64M
elements 5e-2). On the CPU a tensor of up to ``_CHUNK`` elements is converted to float64 once, in cache, for both;
a larger one is summed in float64 a chunk at a time (one conversion of a large tensor would leave the cache), and
its norm is taken over blocks of ``_BLOCK`` elements, then over the blocks' results, and so on, which keeps it
within ~3e-7 in float32 at a third of the float64 cost. CUDA takes both in float64 outright. Devices that may
lack float64 (NPU, MPS) take sums by blocks too.

Bounded memory at any size: a reduction to float64 converts its input first (torch casts before it reduces, on
the CPU and on CUDA alike), a flattened view of a non-contiguous tensor is a copy, and a complex tensor's
magnitudes or a float8 tensor's float32 values are a new tensor. A tensor of more than ``PIECE`` elements is
therefore reduced a piece at a time, each piece a view of at most ``PIECE`` elements (slices of its outer
dimensions), and the pieces' results combined: the max of their maxima, the min of their minima, the float64
sum of their sums, the 2-norm of their norms. A piece's values are copied, widened, into one scratch buffer of
``PIECE`` float64 values (16 MB, kept per device for the next large tensor: fresh allocations of that size
between small ones leave holes the allocator does not give back), and reduced there: nothing holds more than
that beside the tensor, on its device or on the host.

The batching of these results, one transfer per step, is :mod:`.stats`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump.ops import abs as _abs
from pytest_msprobe.dump.ops import amax as _amax
from pytest_msprobe.dump.ops import amin as _amin
from pytest_msprobe.dump.ops import aminmax as _aminmax
from pytest_msprobe.dump.ops import cat as _cat
from pytest_msprobe.dump.ops import copy as _copy
from pytest_msprobe.dump.ops import empty as _empty
from pytest_msprobe.dump.ops import narrow as _narrow
from pytest_msprobe.dump.ops import reshape as _reshape
from pytest_msprobe.dump.ops import stack as _stack
from pytest_msprobe.dump.ops import sum as _sum
from pytest_msprobe.dump.ops import to as _to
from pytest_msprobe.dump.ops import vector_norm as _vector_norm
from pytest_msprobe.dump.ops import view as _view
from pytest_msprobe.dump.ops import view_as_real as _view_as_real

_F32 = torch.float32
_F64 = torch.float64
_LOW_FLOATS = frozenset({torch.float16, torch.bfloat16})
_INTS = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
)
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})

# kinds of tensors, by how their statistics are computed
K_F32, K_LOW, K_F64, K_INT, K_BOOL, K_COMPLEX, K_CAST, K_NONE = range(8)


def kind_of(dtype: torch.dtype) -> int:
    """The kind of ``dtype``: which of the ways below its statistics are taken (look it up in ``KINDS`` first)."""
    if dtype is _F32:
        return K_F32
    if dtype in _LOW_FLOATS:
        return K_LOW
    if dtype is _F64:
        return K_F64
    if dtype in _INTS:
        return K_INT
    if dtype is torch.bool:
        return K_BOOL
    if dtype in _COMPLEX:
        return K_COMPLEX
    if dtype.is_floating_point:  # float8 variants and other exotic floats: computed in float32
        return K_CAST
    return K_NONE  # quantized and the like: no statistics


KINDS: dict[torch.dtype, int] = {}  # kind_of, by dtype, filled as dtypes are seen


# tensors of at most this many elements are copied when seen and reduced at flush (:mod:`.stats`), those of one
# shape together (numeric_rows)
SMALL = 4096
_ONE_PASS = 1 << 19
_CHUNK = 1 << 16
_BLOCK = 2048
_WIDE_SUMS = frozenset({"cpu", "cuda"})  # devices whose sums accumulate in float64
PIECE = 1 << 21  # larger tensors are reduced a piece of at most this many elements at a time


def pieces(t: torch.Tensor, limit: int = PIECE) -> list[torch.Tensor]:
    """Views of ``t`` of at most ``limit`` elements each that together hold each of its elements once: runs of
    slices along its outer dimension, and of a slice's own outer dimension where one slice is larger."""
    if t.numel() <= limit or t.dim() == 0:
        return [t]
    size = t.shape[0]
    inner = t.numel() // size
    if inner > limit:  # one slice is already too large: each slice in pieces
        return [p for k in range(size) for p in pieces(t[k], limit)]
    step = limit // inner
    return [_narrow(t, 0, at, min(step, size - at)) for at in range(0, size, step)]


def _blocks(flat: torch.Tensor, reduce: Callable[..., torch.Tensor], dtype: Any) -> torch.Tensor:
    """``reduce`` (a sum or a 2-norm, which combine blockwise) of a 1-d tensor, block by block, each level's
    results reduced again until one block is left: no accumulation runs over more than ``_BLOCK`` terms."""
    n = flat.shape[0]
    while n > _BLOCK:
        whole = n - n % _BLOCK
        level = reduce(_reshape(_narrow(flat, 0, 0, whole), (-1, _BLOCK)), 1, dtype=dtype)
        if whole != n:
            rest = reduce(_narrow(flat, 0, whole, n - whole), 0, dtype=dtype)
            level = _cat((level, _reshape(rest, (1,))))
        flat, n, dtype = level, level.shape[0], None
    return reduce(flat, 0, dtype=dtype)


def _block_sum(t: torch.Tensor, dim: int, dtype: Any = None) -> torch.Tensor:
    return _sum(t, dim, dtype=dtype)


def _block_norm(t: torch.Tensor, dim: int, dtype: Any = None) -> torch.Tensor:
    return _vector_norm(t, 2, dim, dtype=dtype)


def _chunk_sum(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The float64 sum of a 1-d tensor of ``n`` elements, a chunk of ``_CHUNK`` at a time, then over the chunks'
    sums. The whole chunks are summed in one operator, a row each: half the time of one operator a chunk at a
    million elements, and from two rows up each row is summed by one thread, so the bits do not depend on
    torch's thread count (one sum over a whole chunk is split between the threads)."""
    whole = n - n % _CHUNK
    sums = _sum(_reshape(_narrow(flat, 0, 0, whole), (-1, _CHUNK)), 1, dtype=_F64)
    if whole != n:
        sums = _cat((sums, _reshape(_sum(_narrow(flat, 0, whole, n - whole), dtype=_F64), (1,))))
    return _sum(sums)


def _sum_and_norm(t: torch.Tensor) -> tuple[Any, Any]:
    """The sum and 2-norm of a non-empty tensor, accurate whatever its size (see the module's docstring); float16
    and bfloat16 accumulate in float32 at least."""
    device = t.device.type
    if device == "cuda":  # one conversion for both (a reduction to float64 converts its input first)
        wide = _to(t, _F64)
        return _sum(wide), _vector_norm(wide)
    n = t.numel()
    low = _F32 if t.dtype in _LOW_FLOATS else None
    if device == "cpu":
        if n <= _CHUNK:
            wide = _to(t, _F64)
            return _sum(wide), _vector_norm(wide)
        flat = _reshape(t, (-1,))  # a view of a contiguous tensor; a copy of another
        return _chunk_sum(flat, n), _blocks(flat, _block_norm, low)
    if n <= _BLOCK:
        return _sum(t, dtype=low), _vector_norm(t, dtype=low)
    flat = _reshape(t, (-1,))
    return _blocks(flat, _block_sum, low), _blocks(flat, _block_norm, low)


def numeric(t: torch.Tensor, kind: int) -> tuple[Any, Any, Any, Any]:
    """Max, min, sum and 2-norm of a non-empty tensor with at least one dimension (no host sync), a piece at a
    time beyond ``PIECE`` elements."""
    if t.numel() <= PIECE:
        return _numeric(t, kind)
    return _by_pieces(t, kind)


# scratch buffers for the pieces of large tensors, by device and dtype: taken while in use (a second thread
# makes its own), kept after, so that a step's large tensors reuse one allocation instead of leaving holes
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _by_pieces(t: torch.Tensor, kind: int) -> tuple[Any, Any, Any, Any]:
    """:func:`numeric` of a large tensor, its pieces' values widened into one scratch buffer (float64 where
    sums are, the magnitudes of a complex tensor), their results combined in the dtypes ``_numeric`` gives."""
    device = t.device
    like = _numeric(_reshape(t[(0,) * t.dim()], (1,)), kind)  # the dtypes of each result
    wide = _F64 if device.type in _WIDE_SUMS or kind == K_F64 else _F32
    key = (device, wide)
    scratch = _SCRATCH.pop(key, None)
    if scratch is None:
        scratch = _empty(PIECE, dtype=wide, device=device)
    try:
        maxes, mins, sums, norms = [], [], [], []
        complex_ = kind == K_COMPLEX
        # a complex piece's real and imaginary parts fill the first half, its magnitudes the third quarter
        for piece in pieces(t, PIECE // 4 if complex_ else PIECE):
            n = piece.numel()
            values = _view(_narrow(scratch, 0, PIECE // 2 if complex_ else 0, n), piece.shape)
            if complex_:
                parts = _view(_narrow(scratch, 0, 0, 2 * n), (*piece.shape, 2))
                _copy(parts, _view_as_real(piece))
                _vector_norm(parts, 2, -1, out=values)
                source = values
            else:
                _copy(values, piece)
                source = values if kind == K_CAST else piece  # float8 and the like lack amax
            maxes.append(_amax(source))
            mins.append(_amin(source))
            # by rows, each summed by one thread: the bits do not depend on torch's thread count
            flat = _reshape(values, (-1,))
            sums.append(_chunk_sum(flat, n) if device.type in _WIDE_SUMS else _blocks(flat, _block_sum, None))
            if like[3] is not None:
                norms.append(_blocks(flat, _block_norm, None))
    finally:
        _SCRATCH[key] = scratch
    mx = _to(_amax(_stack(maxes)), like[0].dtype)
    mn = _to(_amin(_stack(mins)), like[1].dtype)
    total = _to(_sum(_stack(sums)), like[2].dtype)
    norm = None if like[3] is None else _to(_vector_norm(_stack(norms)), like[3].dtype)
    return mx, mn, total, norm


def _numeric(t: torch.Tensor, kind: int) -> tuple[Any, Any, Any, Any]:
    """:func:`numeric` of a tensor of at most ``PIECE`` elements."""
    if kind in (K_F32, K_F64):
        # on the CPU, aminmax is one pass but slower per element than amax or amin: two passes win while the
        # tensor fits in the cache, one pass beyond (from 2^19 elements: 1.4 ms instead of 1.9 ms at 2.4M); on
        # CUDA it is one kernel launch instead of two; other devices take amax and amin
        n = t.numel()
        device = t.device.type
        if n > SMALL and device != "cuda" and (n <= _ONE_PASS or device != "cpu"):
            return (_amax(t), _amin(t), *_sum_and_norm(t))
        mn, mx = _aminmax(t)
        return (mx, mn, *_sum_and_norm(t))
    if kind == K_LOW:
        mn, mx = _aminmax(t)
        return (mx, mn, *_sum_and_norm(t))
    if kind == K_INT:
        mn, mx = _aminmax(t)  # exact, in the integer dtype
        return (mx, mn, *_sum_and_norm(_to(t, _F64 if t.device.type in _WIDE_SUMS else _F32)))
    if kind == K_COMPLEX:
        mag = _abs(t)
        mn, mx = _aminmax(mag)
        return mx, mn, _sum_and_norm(mag)[0], None
    as_float = _to(t, _F32)  # K_CAST: float8 and other exotic floats, in float32
    mn, mx = _aminmax(as_float)
    return (mx, mn, *_sum_and_norm(as_float))


def numeric_rows(
    rows: torch.Tensor, kind: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Max, min, sum and 2-norm of each row of ``rows``, small tensors of one shape and kind (``K_F32``,
    ``K_F64`` or ``K_LOW``) stacked: the same reduction, bitwise, as :func:`numeric` of each alone."""
    # amax and amin: aminmax along a dimension is many times slower on CPU
    mx, mn = _amax(rows, 1), _amin(rows, 1)
    # each row is at most one block and one chunk: accumulated as _sum_and_norm does a tensor that size
    device = rows.device.type
    if device == "cpu":
        wide = _to(rows, _F64)
        return mx, mn, _sum(wide, 1), _vector_norm(wide, 2, 1)
    acc = _F64 if device == "cuda" else _F32 if kind == K_LOW else None
    return mx, mn, _sum(rows, 1, dtype=acc), _vector_norm(rows, 2, 1, dtype=acc)
