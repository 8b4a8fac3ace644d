"""A tensor file as ``torch.save`` writes it, written in one system call: the tensor files of task ``tensor``.

``torch.save`` spends most of its time per file on its own machinery (a Python pickler with a persistent-id hook,
the zip writer's records one by one), not on the bytes: a step of task tensor writes hundreds of files, and the
format is simple. This module writes the same archive, a zip of stored (uncompressed) records that ``torch.load``
reads, ``weights_only`` included::

    <stem>/data.pkl                 the pickle of _rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())
    <stem>/.format_version          "1"
    <stem>/.storage_alignment       "64"
    <stem>/byteorder                "little" | "big"
    <stem>/data/0                   the tensor's bytes, at an offset that is a multiple of 64 (as torch aligns them)
    <stem>/version                  "3\\n"
    <stem>/.data/serialization_id   a unique decimal id

Each record's CRC-32 is real (:mod:`pytest_msprobe.format.crc`). The header, the records
and the central directory are laid out in memory and written with the tensor's bytes in one ``os.writev`` (the
tensor is not copied). Tensors this writer does not cover (a dtype without a legacy storage class, a view into a
larger storage, more than 2 GiB) go through ``torch.save`` itself: :func:`save_tensor` always writes a file
``torch.load`` reads.
"""

from __future__ import annotations

import collections
import io
import itertools
import os
import pickle
import struct
import sys
from typing import Any

import torch

from pytest_msprobe.format.crc import crc32

_ALIGN = 64
_LIMIT = 2**31  # above it, zip64 records would be needed: torch.save writes those
_FLAGS = 0x0800  # names in UTF-8
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")

# torch.load's weights_only unpickler accepts these legacy storage classes (what torch.save itself writes)
_STORAGES: dict[torch.dtype, str] = {
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}
_IDS = itertools.count(int.from_bytes(os.urandom(8), "little"))


class _Storage:
    """Stands for the tensor's storage in the pickle: written as its persistent id."""


_STORAGE = _Storage()


class _Rebuild:
    """Pickles as torch's ``_rebuild_tensor_v2(...)`` call of a plain tensor."""

    def __init__(self, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args: tuple[Any, ...] = (_STORAGE, 0, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pid: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self._pid = pid

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is _STORAGE else None


def _pickle(t: torch.Tensor) -> bytes:
    storage_class = getattr(torch, _STORAGES[t.dtype])
    buf = io.BytesIO()
    _Pickler(buf, ("storage", storage_class, "0", "cpu", t.numel())).dump(
        _Rebuild(tuple(t.shape), t.stride())
    )
    return buf.getvalue()


def covered(t: torch.Tensor) -> bool:
    """Whether :func:`save_tensor` writes ``t`` itself (else through ``torch.save``)."""
    return bool(
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout is torch.strided
        and t.dtype in _STORAGES
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.numel() * t.element_size() < _LIMIT
    )


def save_tensor(t: torch.Tensor, path: str | os.PathLike[str]) -> None:
    """Write ``t`` to ``path`` as ``torch.save(t, path)`` would (a file ``torch.load`` reads back as ``t``)."""
    if not covered(t):
        torch.save(t, path)
        return
    path = os.fspath(path)
    stem = os.path.splitext(os.path.basename(path))[0] or "archive"
    raw: Any = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    data = memoryview(raw)
    records: list[tuple[str, Any]] = [
        ("data.pkl", _pickle(t)),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", sys.byteorder.encode()),
        ("data/0", data),
        ("version", b"3\n"),
        (".data/serialization_id", str(next(_IDS)).encode()),
    ]
    parts: list[Any] = []
    central: list[bytes] = []
    offset = 0
    for name, body in records:
        full = f"{stem}/{name}".encode()
        size = len(body)
        crc = crc32(body) & 0xFFFFFFFF
        # pad the extra field so that the record's bytes start on a multiple of 64, as torch.save lays them out
        start = offset + _LOCAL.size + len(full) + 4
        pad = -start % _ALIGN
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        parts.append(_LOCAL.pack(0x04034B50, 20, _FLAGS, 0, 0, 0, crc, size, size, len(full), len(extra)))
        parts.append(full)
        parts.append(extra)
        parts.append(body)
        central.append(
            _CENTRAL.pack(
                0x02014B50, 20, 20, _FLAGS, 0, 0, 0, crc, size, size, len(full), 0, 0, 0, 0, 0, offset
            )
            + full
        )
        offset += _LOCAL.size + len(full) + len(extra) + size
    directory = b"".join(central)
    parts.append(directory)
    parts.append(_END.pack(0x06054B50, 0, 0, len(records), len(records), len(directory), offset, 0))
    _write_all(path, parts)


def _write_all(path: str, parts: list[Any]) -> None:
    """Write ``parts`` (bytes and memoryviews) to a new file ``path`` with as few system calls as they allow."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        if not hasattr(os, "writev"):  # Windows
            for view in views:
                while view:
                    view = view[os.write(fd, view) :]
            return
        while views:
            # writev takes at most IOV_MAX buffers and may write less than asked
            written = os.writev(fd, views[:1024])
            while written and views:
                if written >= len(views[0]):
                    written -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][written:]
                    written = 0
    finally:
        os.close(fd)
