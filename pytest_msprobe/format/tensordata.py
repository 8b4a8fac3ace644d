"""The values of a dumped tensor: torch's dtypes as bytes on disk and as the dtype they are compared in, and
:class:`TensorFile`, an opened tensor file whose values are read block by block.

bfloat16 and float8 are widened to float32 (bfloat16: its 16 bits are the top half of a float32); complex
values are compared as interleaved reals.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import unreadable

# torch dtype name -> (numpy dtype of the bytes on disk, little-endian)
DISK_DTYPES: dict[str, str] = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "?",
    "complex128": "<c16",
    "complex64": "<c8",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
    "float8_e4m3fnuz": "u1",
    "float8_e5m2fnuz": "u1",
}

# Types whose values float32 holds exactly are computed in float32; the others in float64.
_FLOAT32_EXACT = {"float32", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "bool"}
_FLOAT32_EXACT |= {name for name in DISK_DTYPES if name.startswith("float8")}


def compute_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype a tensor of torch dtype ``dtype`` is compared in (float32 where that is exact)."""
    return np.dtype(np.float32) if dtype in _FLOAT32_EXACT else np.dtype(np.float64)


def _float8_table(exp_bits: int, man_bits: int, bias: int, fn: bool, uz: bool) -> np.ndarray:
    """float32 value of every 8-bit pattern of a float8 format (``fn``: no inf, ``uz``: unsigned zero)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    normal = (1.0 + man / (1 << man_bits)) * np.exp2(exp - bias)
    subnormal = (man / (1 << man_bits)) * np.exp2(1 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << exp_bits) - 1
    if uz:
        values[0x80] = np.nan  # the "negative zero" pattern is the only NaN
    elif fn:
        values[(exp == top) & (man == (1 << man_bits) - 1)] = np.nan
    else:  # IEEE-like: top exponent holds inf and NaN
        values[(exp == top) & (man == 0)] = sign[(exp == top) & (man == 0)] * np.inf
        values[(exp == top) & (man != 0)] = np.nan
    return values.astype(np.float32)


_FLOAT8_TABLES = {
    "float8_e4m3fn": lambda: _float8_table(4, 3, 7, fn=True, uz=False),
    "float8_e5m2": lambda: _float8_table(5, 2, 15, fn=False, uz=False),
    "float8_e4m3fnuz": lambda: _float8_table(4, 3, 8, fn=True, uz=True),
    "float8_e5m2fnuz": lambda: _float8_table(5, 2, 16, fn=True, uz=True),
}


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Turn raw on-disk values of torch dtype ``dtype`` into the dtype they are compared in."""
    target = compute_dtype(dtype)
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype in _FLOAT8_TABLES:
        return _FLOAT8_TABLES[dtype]()[raw]
    if dtype.startswith("complex"):
        # compare real and imaginary parts as interleaved reals
        return np.ascontiguousarray(raw).view(raw.real.dtype).astype(target, copy=False)
    return raw.astype(target, copy=False)


def _read_into(fh: io.RawIOBase, buf: memoryview) -> int:
    """Fill ``buf`` from ``fh``: the bytes read, fewer only at the end of the file. One read of a raw file
    may give fewer bytes than asked and more remain (Linux gives at most 2 GiB a read; a signal cuts one short)."""
    done = 0
    while done < len(buf):
        got = fh.readinto(buf[done:])
        if not got:
            break
        done += got
    return done


@dataclass(frozen=True)
class TensorFile:
    """One dumped tensor, opened but not read: its torch dtype, shape, and how to read its values.

    ``blocks(n)`` yields the values in C order, ``n`` at a time, in :func:`compute_dtype`; ``read()`` returns
    them all at once. Values are read from disk when asked for, so a compare keeps one pair in memory.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    # a contiguous run of the file holding the values in order (the usual case) ...
    data_offset: int = -1
    disk_dtype: str = ""
    # ... or the values themselves, already loaded (npy, views with gaps, legacy archives)
    array: np.ndarray | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def blocks(self, block: int) -> Iterator[np.ndarray]:
        """Yield the flattened values, ``block`` elements at a time, widened to the compute dtype."""
        total = self.numel
        if self.array is not None:
            flat = self.array.reshape(-1)
            for start in range(0, total, block):
                yield widen(flat[start : start + block], self.dtype)
            return
        disk = np.dtype(self.disk_dtype)
        try:
            fh = open(self.path, "rb", buffering=0)  # noqa: SIM115 (closed below, across the yields)
        except OSError as exc:
            raise unreadable(self.path, exc, "cannot read tensor file") from None
        with fh:
            fh.seek(self.data_offset)
            buf = np.empty(min(block, total), dtype=disk)
            for start in range(0, total, block):
                count = min(block, total - start)
                view = buf[:count]
                try:
                    got = _read_into(fh, view.view(np.uint8).data)
                except OSError as exc:
                    raise unreadable(self.path, exc, "cannot read tensor data") from None
                if got != count * disk.itemsize:
                    raise DumpFormatError(self.path, "tensor data is truncated")
                yield widen(view if disk.isnative else view.astype(disk.newbyteorder("=")), self.dtype)

    def read(self) -> np.ndarray:
        """All values, widened to the compute dtype, in the tensor's shape."""
        if self.numel == 0:
            return np.zeros(self.shape, dtype=compute_dtype(self.dtype))
        parts = list(self.blocks(self.numel))
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if self.dtype.startswith("complex"):
            return flat.reshape((*self.shape, 2))
        return flat.reshape(self.shape)
