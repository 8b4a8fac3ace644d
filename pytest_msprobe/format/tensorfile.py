"""Read dumped tensor files (``torch.save`` archives and ``.npy``) without importing torch.

``torch.save`` writes a zip archive whose members are stored uncompressed: ``<name>/data.pkl`` (a small pickle
that rebuilds the tensor from storages) and ``<name>/data/<key>`` (each storage's raw bytes). Reading it with
torch costs ~2 s and ~650 MB just to import torch, so this module does what ``torch.load(weights_only=True)``
does for a plain tensor, with numpy:

* the pickle is first walked without being run (every opcode a saved tensor does not need is refused, and no
  declared length is trusted before the bytes are there), then read by an unpickler whose only reachable
  globals are an allow-list mapped to constructors of this module (a hostile pickle cannot run code:
  anything else is refused with :class:`DumpFormatError`);
* the storage bytes are read straight from the archive at their offset (one read per block, no copy of the
  archive), honouring the storage offset, size and stride, with checks that they fit the bytes on disk;
* bfloat16 and float8 are widened to float32 (bfloat16: its 16 bits are the top half of a float32).

Archives in torch's legacy (pre-1.6, non-zip) format, recognised by their magic number, fall back to
``torch.load(weights_only=True)``. Every unusable file (missing, a folder, empty, truncated, corrupt, hostile,
holding another dtype or shape than its dump.json record) raises :class:`DumpFormatError` naming it.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
import struct
import warnings
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_msprobe.errors import DumpFormatError

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

# torch dtype name -> (numpy dtype of the bytes on disk, little-endian)
_DISK_DTYPES: dict[str, str] = {
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
_FLOAT32_EXACT |= {name for name in _DISK_DTYPES if name.startswith("float8")}


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


# ----------------------------------------------------------------------------------------- restricted pickle
@dataclass(frozen=True)
class _StorageClass:
    dtype: str | None  # None: an untyped storage, whose dtype comes with the tensor (rebuild v3)


@dataclass(frozen=True)
class _DType:
    name: str


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: str | None
    numel: int  # elements for a typed storage, bytes for an untyped one


@dataclass(frozen=True)
class _TensorSpec:
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
    if dtype not in _DISK_DTYPES:
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
    elif module == "torch" and name in _DISK_DTYPES:
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


# ------------------------------------------------------------------------------------------------ the file
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
            raise DumpFormatError(self.path, f"cannot read tensor file ({exc.strerror or exc})") from None
        with fh:
            fh.seek(self.data_offset)
            buf = np.empty(min(block, total), dtype=disk)
            for start in range(0, total, block):
                count = min(block, total - start)
                view = buf[:count]
                try:
                    got = fh.readinto(view.view(np.uint8).data)
                except OSError as exc:
                    raise DumpFormatError(
                        self.path, f"cannot read tensor data ({exc.strerror or exc})"
                    ) from None
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


# torch's format before 1.6 starts with this pickled magic number (0x1950a86a20f9469cfc6c)
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


def open_tensor(
    path: str | os.PathLike[str],
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
) -> TensorFile:
    """Open a dumped tensor (``torch.save`` zip archive, legacy torch file, or ``.npy``) for reading.

    Only the header is read (the pickle of a torch archive, the header of a .npy), so opening is cheap
    whatever the tensor's size; the values are read by :meth:`TensorFile.blocks`. With ``dtype`` (torch's
    name, ``torch.float32`` or ``float32``) and ``shape``, a file holding another tensor than its dump.json
    record describes is refused. Every unusable file raises :class:`DumpFormatError` naming it.
    """
    path = os.fspath(path)
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise DumpFormatError(path, "is a folder, not a tensor file")
        if not stat.S_ISREG(info.st_mode):
            raise DumpFormatError(path, "not a regular file")
        with open(path, "rb") as fh:
            magic = fh.read(len(_LEGACY_MAGIC))
    except OSError as exc:
        raise DumpFormatError(path, f"cannot read tensor file ({exc.strerror or exc})") from None
    if not magic:
        raise DumpFormatError(path, "empty file (0 bytes)")
    if magic.startswith(b"\x93NUMPY"):
        tensor = _open_npy(path)
    elif magic.startswith(b"PK"):
        tensor = _open_torch_zip(path, info.st_size)
    elif magic == _LEGACY_MAGIC:
        tensor = _open_torch_legacy(path)
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
    names = {np.dtype(v).str: k for k, v in _DISK_DTYPES.items() if not k.startswith(("bfloat", "float8"))}
    dtype = names.get(array.dtype.newbyteorder("<").str if array.dtype.byteorder == ">" else array.dtype.str)
    if dtype is None:
        raise DumpFormatError(path, f"unsupported .npy dtype {array.dtype}")
    return TensorFile(path, dtype, tuple(int(s) for s in array.shape), array=array)


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


def _open_torch_zip(path: str, file_size: int) -> TensorFile:
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
        raise DumpFormatError(path, f"corrupt torch archive ({str(exc) or type(exc).__name__})") from None
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
    disk = np.dtype(_DISK_DTYPES[spec.dtype])
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
        raise DumpFormatError(path, f"corrupt torch archive ({str(exc) or type(exc).__name__})") from None
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
        raise DumpFormatError(path, f"cannot read tensor file ({exc.strerror or exc})") from None
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise DumpFormatError(path, "corrupt torch archive (bad local header)")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return member.header_offset + 30 + name_len + extra_len


def _read_member(path: str, member: zipfile.ZipInfo, disk: np.dtype[Any], count: int) -> np.ndarray:
    if member.compress_type == zipfile.ZIP_STORED:
        return np.fromfile(path, dtype=disk, count=count, offset=_member_data_offset(path, member))
    with zipfile.ZipFile(path) as archive:
        return np.frombuffer(archive.read(member.filename), dtype=disk, count=count)


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
    if dtype not in _DISK_DTYPES:
        raise DumpFormatError(path, f"unsupported tensor dtype {dtype}")
    value = value.detach().contiguous()
    if dtype == "bfloat16" or dtype.startswith("float8"):
        array = value.view(torch.uint16 if dtype == "bfloat16" else torch.uint8).numpy()
    else:
        array = value.numpy()
    return TensorFile(path, dtype, tuple(value.shape), array=array)
