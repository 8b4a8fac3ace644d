"""Tensor statistics computed on the tensor's device, moved to the host once per step.

For every tensor a record mentions, the engine builds msprobe's JSON item (``type``, ``dtype``, ``shape``,
``Max``, ``Min``, ``Mean``, ``Norm``, ``requires_grad`` [, ``md5``] [, ``data_name``]) with the four statistics
left as placeholders. The statistics themselves are 0-d tensors on the tensor's device, appended to per
(dtype, device) buckets; :meth:`StatEngine.flush` stacks each bucket and moves it to the host in one transfer,
then fills the placeholders. Nothing here calls ``.item()``, ``bool()`` or ``.tolist()`` per tensor.

What msprobe writes, reproduced here:

- floating tensors: Max/Min of the data, Mean and Norm (2-norm); float16/bfloat16 are accumulated in float32,
  float64 stays float64;
- integer tensors: Max/Min exact, Mean/Norm of the values cast to float32;
- 0-d tensors: Max = Min = Mean = Norm = the value (an int stays an int, a negative "Norm" is what msprobe writes);
- bool tensors: Max = any, Min = all, Mean = Norm = null;
- complex tensors: Max/Min/Mean of the absolute values, Norm null;
- empty (and meta) tensors: all four null.

A small cache keyed on the tensor object (held strongly, checked against ``t._version``) reuses the statistics
of a tensor seen again unchanged: an API's output is usually the next API's input, and a gradient flowing out of
one node flows into the next.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Optional

import torch

_VF: Any = torch._C._VariableFunctions
_TB: Any = torch._C.TensorBase
# the C functions themselves: the dump's own computations must not go through the API wrappers
_aminmax = _VF.aminmax
_mean = _VF.mean
_abs = _VF.abs
_clone = _VF.clone
_stack = _VF.stack
_vector_norm = torch._C._linalg.linalg_vector_norm  # type: ignore[attr-defined]
_detach = _TB.detach
_to = _TB.to
_contiguous = _TB.contiguous
_reshape = _TB.reshape
_view_dtype = _TB.view

_F32 = torch.float32
_F64 = torch.float64
_LOW_FLOATS = frozenset({torch.float16, torch.bfloat16})
_INTS = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
)
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})

# kinds of tensors, by how their statistics are computed
_K_F32, _K_LOW, _K_F64, _K_INT, _K_BOOL, _K_COMPLEX, _K_CAST, _K_NONE = range(8)


def _kind_of(dtype: torch.dtype) -> int:
    if dtype is _F32:
        return _K_F32
    if dtype in _LOW_FLOATS:
        return _K_LOW
    if dtype is _F64:
        return _K_F64
    if dtype in _INTS:
        return _K_INT
    if dtype is torch.bool:
        return _K_BOOL
    if dtype in _COMPLEX:
        return _K_COMPLEX
    if dtype.is_floating_point:  # float8 variants and other exotic floats: computed in float32
        return _K_CAST
    return _K_NONE  # quantized and the like: no statistics


_KINDS: dict[torch.dtype, int] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"torch.float32"`` (cached)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


class _Bucket:
    """0-d statistic tensors of one dtype on one device, stacked and moved to the host at flush."""

    __slots__ = ("host", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.host: list[Any] = []


_Ref = Optional[tuple[_Bucket, int]]
_Stats = tuple[_Ref, _Ref, _Ref, _Ref]
_NO_STATS: _Stats = (None, None, None, None)


def crc32_hex(t: torch.Tensor) -> str:
    """CRC32 of a CPU tensor's bytes in row-major order, as 8 hex digits (msprobe's "md5" field)."""
    data = _contiguous(_detach(t))
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    if data.numel() == 0:
        return f"{zlib.crc32(b''):08x}"
    raw = _view_dtype(_reshape(data, (-1,)), torch.uint8)
    return f"{zlib.crc32(raw.numpy()):08x}"


class StatEngine:
    """Builds tensor items for one step and resolves their statistics at :meth:`flush`.

    ``md5``: add a CRC32 of each tensor, from a snapshot taken when the item is built. ``tensor_sink``: when
    given (task ``tensor``), it receives ``(data_name, snapshot)`` for every tensor item, the snapshot being a
    contiguous copy taken at that moment (so later in-place changes do not reach the file).
    """

    def __init__(
        self,
        md5: bool = False,
        tensor_sink: Callable[[str, torch.Tensor], None] | None = None,
        cache_size: int = 64,
    ) -> None:
        self.md5 = md5
        self.tensor_sink = tensor_sink
        self._buckets: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        self._pending: list[tuple[dict[str, Any], _Stats]] = []
        self._pending_crc: list[tuple[dict[str, Any], torch.Tensor]] = []
        # id(tensor) -> (tensor, version, stats, crc, snapshot)
        self._cache: dict[int, tuple[torch.Tensor, int, _Stats, str | None, torch.Tensor | None]] = {}
        self._cache_size = cache_size

    # -- building items -------------------------------------------------------------------------------------

    def item(self, t: torch.Tensor, data_name: str | None = None, remember: bool = False) -> dict[str, Any]:
        """The JSON item of tensor ``t``; its statistics are filled in at :meth:`flush`.

        ``remember``: keep the results for a later item of the same, unchanged tensor (use it for outputs and
        gradients, never for inputs that an operator may change without bumping ``_version``, such as
        batch_norm's running statistics).
        """
        item: dict[str, Any] = {
            "type": "torch.Tensor",
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "Max": None,
            "Min": None,
            "Mean": None,
            "Norm": None,
            "requires_grad": t.requires_grad,
        }
        key = id(t)
        hit = self._cache.get(key)
        version = t._version
        if hit is not None and hit[0] is t and hit[1] == version:
            stats, crc, snap = hit[2], hit[3], hit[4]
        else:
            stats = self._compute(t)
            crc = None
            snap = None
            if self.md5:
                if t.device.type == "cpu":
                    crc = crc32_hex(t)
                else:
                    snap = _clone(_detach(t), memory_format=torch.contiguous_format)
            if self.tensor_sink is not None and snap is None:
                snap = _clone(_detach(t), memory_format=torch.contiguous_format)
            if remember:
                cache = self._cache
                if len(cache) >= self._cache_size:
                    del cache[next(iter(cache))]
                cache[key] = (t, version, stats, crc, snap)
        if stats is not _NO_STATS:
            self._pending.append((item, stats))
        if self.md5:
            if crc is not None:
                item["md5"] = crc
            elif snap is not None:
                item["md5"] = None
                self._pending_crc.append((item, snap))
        if self.tensor_sink is not None and data_name is not None and snap is not None:
            item["data_name"] = data_name
            self.tensor_sink(data_name, snap)
        return item

    def _bucket(self, stat: torch.Tensor) -> _Bucket:
        key = (stat.dtype, stat.device)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def _put(self, stat: torch.Tensor) -> tuple[_Bucket, int]:
        bucket = self._bucket(stat)
        tensors = bucket.tensors
        tensors.append(stat)
        return bucket, len(tensors) - 1

    def _compute(self, t: torch.Tensor) -> _Stats:
        """Launch the statistics of ``t`` (no host sync); returns references resolved at flush."""
        kind = _KINDS.get(t.dtype)
        if kind is None:
            kind = _KINDS[t.dtype] = _kind_of(t.dtype)
        if kind == _K_NONE or t.numel() == 0 or t.is_meta or t.layout is not torch.strided:
            return _NO_STATS
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._compute_kind(t, kind)
        except RuntimeError:
            # an operator this device/dtype lacks: leave the statistics empty rather than break training
            return _NO_STATS
        finally:
            torch._C._set_grad_enabled(prev)

    def _compute_kind(self, t: torch.Tensor, kind: int) -> _Stats:
        put = self._put
        if kind == _K_BOOL:
            mn, mx = _aminmax(t)  # max = any, min = all
            return put(mx), put(mn), None, None
        if t.dim() == 0:
            ref = put(_clone(t))
            return ref, ref, ref, ref
        if kind in (_K_F32, _K_F64):
            mn, mx = _aminmax(t)
            return put(mx), put(mn), put(_mean(t)), put(_vector_norm(t))
        if kind == _K_LOW:
            mn, mx = _aminmax(t)
            return put(mx), put(mn), put(_mean(t, dtype=_F32)), put(_vector_norm(t, dtype=_F32))
        if kind == _K_INT:
            mn, mx = _aminmax(t)
            as_float = _to(t, _F32)
            return put(mx), put(mn), put(_mean(as_float)), put(_vector_norm(as_float))
        if kind == _K_COMPLEX:
            mag = _abs(t)
            mn, mx = _aminmax(mag)
            return put(mx), put(mn), put(_mean(mag)), None
        as_float = _to(t, _F32)  # _K_CAST
        mn, mx = _aminmax(as_float)
        return put(mx), put(mn), put(_mean(as_float)), put(_vector_norm(as_float))

    # -- resolving --------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Move every bucket to the host (one transfer each) and fill the items built so far."""
        for bucket in self._buckets.values():
            if bucket.tensors:
                bucket.host = _stack(bucket.tensors).tolist()
        for item, (r_max, r_min, r_mean, r_norm) in self._pending:
            if r_max is not None:
                item["Max"] = r_max[0].host[r_max[1]]
            if r_min is not None:
                item["Min"] = r_min[0].host[r_min[1]]
            if r_mean is not None:
                item["Mean"] = r_mean[0].host[r_mean[1]]
            if r_norm is not None:
                item["Norm"] = r_norm[0].host[r_norm[1]]
        for item, snap in self._pending_crc:
            item["md5"] = crc32_hex(snap.cpu())
        # everything built so far is resolved: start afresh (a later start() in the same step adds to the items)
        self._pending.clear()
        self._pending_crc.clear()
        for bucket in self._buckets.values():
            bucket.tensors = []
        self._cache.clear()

    def clear_cache(self) -> None:
        """Drop the reuse cache (and the tensors it keeps alive)."""
        self._cache.clear()
