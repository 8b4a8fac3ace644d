"""``torch.save``'s zip archive of one tensor, read without torch.

``torch.save`` writes a zip archive whose members are stored uncompressed: ``<name>/data.pkl`` (a small pickle
that rebuilds the tensor from storages) and ``<name>/data/<key>`` (each storage's raw bytes). This module does
what ``torch.load(weights_only=True)`` does for a plain tensor, with numpy:

* the pickle is first walked without being run (every opcode a saved tensor does not need is refused, and no
  declared length is trusted before the bytes are there), then read by an unpickler whose only reachable
  globals are an allow-list mapped to constructors of this module (a hostile pickle cannot run code:
  anything else is refused with :class:`DumpFormatError`);
* the storage bytes are read straight from the archive at their offset (one read per block, no copy of the
  archive), honouring the storage offset, size and stride, with checks that they fit the bytes on disk.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import warnings
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import MACHINE_ERRNOS, unreadable
from pytest_msprobe.format.tensordata import DISK_DTYPES, TensorFile

# ----------------------------------------------------------------------------------------- restricted pickle
# data.pkl of one tensor is ~200 bytes; anything far larger is not a single dumped tensor.
_MAX_PICKLE_BYTES = 1 << 20

# storage class name (torch < 2.x naming, still what torch.save writes) -> torch dtype name
_STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


@dataclass(frozen=True)
class _StorageClass:
    dtype: str | None  # None: an untyped storage, whose dtype comes with the tensor (rebuild v3)


@dataclass(frozen=True)
class _DType:
    name: str


class _StorageRef(NamedTuple):
    """A storage a tensor's pickle names: its key in the zip's data/ folder, dtype and size."""

    key: str
    dtype: str | None
    numel: int  # elements for a typed storage, bytes for an untyped one


class _TensorSpec(NamedTuple):
    """A tensor as its pickle rebuilds it: a view (offset, shape, stride) of one storage."""

    storage: _StorageRef
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"bad tensor {what}: {value!r}")
    return tuple(value)


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None) -> _TensorSpec:
    if not isinstance(storage, _StorageRef):
        raise ValueError("tensor storage is not a persistent storage reference")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"bad storage offset {offset!r}")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError(f"size {shape} and stride {strides} differ in length")
    dtype = dtype or storage.dtype
    if dtype not in DISK_DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype!r}")
    return _TensorSpec(storage, dtype, offset, shape, strides)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorSpec:
    return _rebuild(storage, offset, size, stride, None)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> _TensorSpec:
    if not isinstance(dtype, _DType):
        raise ValueError("tensor dtype is not a torch dtype")
    return _rebuild(storage, offset, size, stride, dtype.name)


def _rebuild_parameter(data: Any, *_rest: Any) -> _TensorSpec:
    if not isinstance(data, _TensorSpec):
        raise ValueError("parameter data is not a tensor")
    return data


def _allowed_global(module: str, name: str) -> Any:
    if module == "torch._utils":
        found = {
            "_rebuild_tensor_v2": _rebuild_tensor_v2,
            "_rebuild_tensor_v3": _rebuild_tensor_v3,
            "_rebuild_parameter": _rebuild_parameter,
            "_rebuild_parameter_with_state": _rebuild_parameter,
        }.get(name)
        if found is not None:
            return found
    elif module == "torch" and name in _STORAGE_CLASSES:
        return _StorageClass(_STORAGE_CLASSES[name])
    elif module == "torch" and name in DISK_DTYPES:
        return _DType(name)
    elif module == "torch.storage" and name == "UntypedStorage":
        return _StorageClass(None)
    elif module == "collections" and name == "OrderedDict":
        return OrderedDict
    return None


# The opcodes of the pickle of a saved tensor (torch.save, protocols 2 to 4), and the others that only build
# plain values. Left out: everything that builds objects (INST, OBJ, NEWOBJ, BUILD), the out-of-band buffers
# of protocol 5, and BYTEARRAY8, for which the C unpickler allocates the declared size before reading it.
# fmt: off
_OPCODES = frozenset([
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "GLOBAL", "STACK_GLOBAL", "REDUCE", "BINPERSID",
    "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET", "PUT", "GET",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG", "BINFLOAT", "FLOAT",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "LIST",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
])
# fmt: on


def _check_opcodes(pickled: bytes) -> None:
    """Walk the pickle without running it (lengths are checked against the bytes there, nothing allocated
    from them) and refuse any opcode a saved tensor does not need."""
    with warnings.catch_warnings():  # decoding a text opcode's argument may warn about its escapes
        warnings.simplefilter("ignore")
        for opcode, _, pos in pickletools.genops(pickled):
            if opcode.name not in _OPCODES:
                raise pickle.UnpicklingError(f"refused opcode {opcode.name} at byte {pos}")


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals a plain saved tensor needs; everything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_global(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (only plain tensors are loaded)")
        return found

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage_class, key, _location, numel = pid
        if not isinstance(storage_class, _StorageClass) or not isinstance(key, str) or type(numel) is not int:
            raise pickle.UnpicklingError(f"malformed storage reference {pid!r}")
        if numel < 0 or "/" in key or key in ("", ".", ".."):
            raise pickle.UnpicklingError(f"malformed storage reference {pid!r}")
        return _StorageRef(key, storage_class.dtype, numel)


# ---------------------------------------------------------------------------------------------- the archive
# what reading a damaged zip archive can raise, besides BadZipFile
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,  # an unsupported compression method
    RuntimeError,  # an encrypted member
    EOFError,
    OSError,
    ValueError,
    KeyError,
    struct.error,
    zlib.error,
)


def _zip_error(path: str, exc: BaseException) -> DumpFormatError:
    """A damaged archive; or, for an OSError that is the machine's state, the file unread this time."""
    if isinstance(exc, OSError) and exc.errno in MACHINE_ERRNOS:
        return unreadable(path, exc, "cannot read tensor file")
    return DumpFormatError(path, f"corrupt torch archive ({str(exc) or type(exc).__name__})")


def open_torch_zip(path: str, file_size: int) -> TensorFile:
    """The tensor of the ``torch.save`` archive at ``path`` (``file_size`` bytes): its pickle read and checked,
    its values left on disk where they are stored uncompressed and contiguous."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = {info.filename: info for info in archive.infolist()}
            pkl = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
            if len(pkl) != 1:
                raise DumpFormatError(path, "not a torch.save archive (no <name>/data.pkl)")
            prefix = pkl[0][: -len("data.pkl")]
            if max(infos[pkl[0]].file_size, infos[pkl[0]].compress_size) > _MAX_PICKLE_BYTES:
                raise DumpFormatError(path, "data.pkl is too large for a single tensor")
            pickled = archive.read(pkl[0])
            byteorder = "little"
            order = infos.get(prefix + "byteorder")
            if order is not None:
                if order.file_size > 16:
                    raise DumpFormatError(path, f"unknown byteorder ({order.file_size} bytes)")
                byteorder = archive.read(order).decode("ascii", "replace").strip()
    except _ZIP_ERRORS as exc:
        raise _zip_error(path, exc) from None
    if byteorder not in ("little", "big"):
        raise DumpFormatError(path, f"unknown byteorder {byteorder!r}")

    try:
        _check_opcodes(pickled)
        spec = _Unpickler(io.BytesIO(pickled)).load()
    except Exception as exc:  # any malformed or hostile pickle: refuse, never execute
        raise DumpFormatError(path, f"refused to load: {str(exc) or type(exc).__name__}") from None
    if not isinstance(spec, _TensorSpec):
        raise DumpFormatError(path, f"refused to load: holds a {type(spec).__name__}, not a tensor")

    member = infos.get(f"{prefix}data/{spec.storage.key}")
    if member is None:
        raise DumpFormatError(path, f"storage {spec.storage.key!r} is missing from the archive")
    disk = np.dtype(DISK_DTYPES[spec.dtype])
    if byteorder == "big":
        disk = disk.newbyteorder(">")
    itemsize = disk.itemsize
    storage_elems = spec.storage.numel if spec.storage.dtype is not None else spec.storage.numel // itemsize
    if storage_elems * itemsize > member.file_size:
        raise DumpFormatError(path, "storage is larger than the bytes stored for it")

    numel = 1
    for s in spec.shape:
        numel *= s
    extent = (
        0 if numel == 0 else spec.offset + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride)) + 1
    )
    if extent > storage_elems:
        raise DumpFormatError(
            path, f"tensor of shape {list(spec.shape)} does not fit its storage of {storage_elems} elements"
        )
    base = _member_data_offset(path, member)
    if member.compress_type == zipfile.ZIP_STORED and base + storage_elems * itemsize > file_size:
        raise DumpFormatError(
            path,
            f"tensor data is truncated (its storage needs {storage_elems * itemsize} bytes from offset {base}, "
            f"the file has {file_size})",
        )
    start = base + spec.offset * itemsize
    contiguous = numel == 0 or _is_contiguous(spec.shape, spec.stride)
    if contiguous and member.compress_type == zipfile.ZIP_STORED:
        return TensorFile(path, spec.dtype, spec.shape, data_offset=start, disk_dtype=disk.str)
    # a view with gaps (or a compressed member): load the storage once and gather
    try:
        raw = _read_member(path, member, disk, storage_elems)
    except _ZIP_ERRORS as exc:
        raise _zip_error(path, exc) from None
    if raw.size != storage_elems:  # as_strided must never reach past the bytes read
        raise DumpFormatError(path, "tensor data is truncated")
    view = np.lib.stride_tricks.as_strided(
        raw[spec.offset :], shape=spec.shape, strides=[st * itemsize for st in spec.stride], writeable=False
    )
    array = np.ascontiguousarray(view)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return TensorFile(path, spec.dtype, spec.shape, array=array)


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _member_data_offset(path: str, member: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start: after its local header, whose extra field may differ."""
    try:
        with open(path, "rb") as fh:
            fh.seek(member.header_offset)
            header = fh.read(30)
    except OSError as exc:
        raise unreadable(path, exc, "cannot read tensor file") from None
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise DumpFormatError(path, "corrupt torch archive (bad local header)")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return member.header_offset + 30 + name_len + extra_len


def _read_member(path: str, member: zipfile.ZipInfo, disk: np.dtype[Any], count: int) -> np.ndarray:
    if member.compress_type == zipfile.ZIP_STORED:
        return np.fromfile(path, dtype=disk, count=count, offset=_member_data_offset(path, member))
    with zipfile.ZipFile(path) as archive:
        return np.frombuffer(archive.read(member.filename), dtype=disk, count=count)
