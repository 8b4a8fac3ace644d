"""The compare's tensor files: opened with the torch-free reader of :mod:`pytest_msprobe.format.tensorfile`,
and those in torch's legacy (pre-1.6, non-zip) format, which only torch reads, with
``torch.load(weights_only=True)`` (torch is imported for them alone)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format import tensorfile
from pytest_msprobe.format.tensordata import DISK_DTYPES, TensorFile


def open_tensor(
    path: str | os.PathLike[str], dtype: str | None = None, shape: Sequence[int] | None = None
) -> TensorFile:
    """:func:`pytest_msprobe.format.tensorfile.open_tensor`, reading legacy torch files with torch."""
    return tensorfile.open_tensor(path, dtype, shape, legacy=_open_torch_legacy)


def _open_torch_legacy(path: str) -> TensorFile:
    """Files in torch's pre-zip format: only torch can read them; it does so with weights_only=True."""
    try:
        import torch
    except ImportError:
        raise DumpFormatError(path, "not a zip torch archive or .npy, and torch is not installed") from None
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle protocols: the file is refused anyway
            warnings.simplefilter("ignore")
            value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DumpFormatError(path, f"cannot load tensor ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, torch.Tensor):
        raise DumpFormatError(path, f"holds a {type(value).__name__}, not a tensor")
    dtype = str(value.dtype).replace("torch.", "")
    if dtype not in DISK_DTYPES:
        raise DumpFormatError(path, f"unsupported tensor dtype {dtype}")
    value = value.detach().contiguous()
    if dtype == "bfloat16" or dtype.startswith("float8"):
        array = value.view(torch.uint16 if dtype == "bfloat16" else torch.uint8).numpy()
    else:
        array = value.numpy()
    return TensorFile(path, dtype, tuple(value.shape), array=array)
