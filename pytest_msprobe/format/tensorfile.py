"""Open dumped tensor files (``torch.save`` archives and ``.npy``) without importing torch.

Reading a tensor with torch costs ~2 s and ~650 MB just to import torch, so :func:`open_tensor` recognises the
file by its first bytes and reads it with numpy: a ``.npy`` file with numpy's own (pickle-free) reader, a
``torch.save`` zip archive with :mod:`pytest_msprobe.format.torchzip`. Archives in torch's legacy (pre-1.6,
non-zip) format only torch can read: the caller passes the reader for them (the compare's loads them with
``torch.load(weights_only=True)``). Every unusable file (missing, a folder, empty, truncated, corrupt,
hostile, holding another dtype or shape than its dump.json record) raises :class:`DumpFormatError` naming it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence

import numpy as np

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import unreadable
from pytest_msprobe.format.tensordata import DISK_DTYPES, TensorFile
from pytest_msprobe.format.torchzip import open_torch_zip

# torch's format before 1.6 starts with this pickled magic number (0x1950a86a20f9469cfc6c)
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."

# reads a file in torch's legacy format (path -> its tensor); only torch can, and this package never imports it
LegacyReader = Callable[[str], TensorFile]


def open_tensor(
    path: str | os.PathLike[str],
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    legacy: LegacyReader | None = None,
) -> TensorFile:
    """Open a dumped tensor (``torch.save`` zip archive, legacy torch file, or ``.npy``) for reading.

    Only the header is read (the pickle of a torch archive, the header of a .npy), so opening is cheap
    whatever the tensor's size; the values are read by :meth:`TensorFile.blocks`. With ``dtype`` (torch's
    name, ``torch.float32`` or ``float32``) and ``shape``, a file holding another tensor than its dump.json
    record describes is refused. A legacy torch file is read by ``legacy``, and refused without it. Every
    unusable file raises :class:`DumpFormatError` naming it.
    """
    path = os.fspath(path)
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise DumpFormatError(path, "is a folder, not a tensor file")
        if not stat.S_ISREG(info.st_mode):
            raise DumpFormatError(path, "not a regular file")
        with open(path, "rb") as fh:
            magic = fh.read(len(LEGACY_MAGIC))
    except OSError as exc:
        raise unreadable(path, exc, "cannot read tensor file") from None
    if not magic:
        raise DumpFormatError(path, "empty file (0 bytes)")
    if magic.startswith(b"\x93NUMPY"):
        tensor = _open_npy(path)
    elif magic.startswith(b"PK"):
        tensor = open_torch_zip(path, info.st_size)
    elif magic == LEGACY_MAGIC:
        if legacy is None:
            raise DumpFormatError(path, "a torch file of the legacy (pre-1.6) format, which only torch reads")
        tensor = legacy(path)
    else:
        raise DumpFormatError(path, "not a tensor file (neither a torch.save archive nor a .npy file)")
    if dtype is not None or shape is not None:
        check_tensor(tensor, dtype, shape)
    return tensor


def check_tensor(tensor: TensorFile, dtype: str | None, shape: Sequence[int] | None) -> None:
    """Refuse a tensor file whose dtype or shape is not what its dump.json record says."""
    said = dtype.rsplit(".", 1)[-1] if dtype is not None else tensor.dtype
    said_shape = tuple(shape) if shape is not None else tensor.shape
    if said != tensor.dtype or said_shape != tensor.shape:
        raise DumpFormatError(
            tensor.path,
            f"holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, but dump.json says "
            f"{dtype or tensor.dtype} of shape {list(said_shape)}",
        )


def _open_npy(path: str) -> TensorFile:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy's header parser raises several types; none may run code (no pickle)
        raise DumpFormatError(path, f"not a readable .npy file ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise DumpFormatError(path, "not a readable .npy file (holds no array)")
    names = {np.dtype(v).str: k for k, v in DISK_DTYPES.items() if not k.startswith(("bfloat", "float8"))}
    dtype = names.get(array.dtype.newbyteorder("<").str if array.dtype.byteorder == ">" else array.dtype.str)
    if dtype is None:
        raise DumpFormatError(path, f"unsupported .npy dtype {array.dtype}")
    return TensorFile(path, dtype, tuple(int(s) for s in array.shape), array=array)
