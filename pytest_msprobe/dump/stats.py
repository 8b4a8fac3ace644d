"""Tensor statistics computed on the tensor's device, moved to the host once per step.

For every tensor a record mentions, the engine builds msprobe's JSON item (``type``, ``dtype``, ``shape``,
``Max``, ``Min``, ``Mean``, ``Norm``, ``requires_grad`` [, ``md5``] [, ``data_name``]) with the four statistics
left as placeholders. The statistics themselves are 0-d tensors on the tensor's device, appended to per
(dtype, device) buckets; :meth:`StatEngine.flush` stacks each bucket and moves it to the host in one transfer,
then fills the placeholders. Nothing here calls ``.item()``, ``bool()`` or ``.tolist()`` per tensor. How each
tensor's statistics are reduced, and accumulated accurately, is :mod:`.reductions`'.

What msprobe writes, reproduced here:

- floating tensors: Max/Min of the data, Mean and Norm (2-norm); float16/bfloat16 are accumulated in float32,
  float64 stays float64;
- integer tensors: Max/Min exact, Mean/Norm of the values cast to float32;
- 0-d tensors: Max = Min = Mean = Norm = the value (an int stays an int, a negative "Norm" is what msprobe writes);
- bool tensors: Max = any, Min = all, Mean = Norm = null;
- complex tensors: Max/Min/Mean of the absolute values, Norm null;
- empty (and meta) tensors: all four null.

A small cache keyed on the tensor object (held weakly, checked against ``t._version``) reuses the statistics
of a tensor seen again unchanged: an API's output is usually the next API's input, and a gradient flowing out of
one node flows into the next.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from pytest_msprobe.dump.checksums import crc32_hex
from pytest_msprobe.dump.checksums import crc_pool as _crc_pool
from pytest_msprobe.dump.ops import aminmax as _aminmax
from pytest_msprobe.dump.ops import as_tensor as _as_tensor
from pytest_msprobe.dump.ops import cat as _cat
from pytest_msprobe.dump.ops import clone as _clone
from pytest_msprobe.dump.ops import detach as _detach
from pytest_msprobe.dump.ops import div as _div
from pytest_msprobe.dump.ops import reshape as _reshape
from pytest_msprobe.dump.ops import stack as _stack
from pytest_msprobe.dump.ops import zeros as _zeros
from pytest_msprobe.dump.reductions import (
    K_BOOL,
    K_COMPLEX,
    K_F32,
    K_F64,
    K_LOW,
    K_NONE,
    KINDS,
    SMALL,
    kind_of,
    numeric,
    numeric_rows,
)

_weakref = weakref.ref
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"torch.float32"`` (cached)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


# what a group's columns hold
_G_NUMERIC = 0  # max, min, sum, norm (Mean = sum / count, computed at flush as torch.mean does)
_G_BOOL = 1  # max (any), min (all)
_G_COMPLEX = 2  # max, min, sum of the absolute values; no Norm
_G_SCALAR = 3  # the value of a 0-d tensor: all four statistics


class _Group:
    """Statistics of the tensors of one dtype on one device: one row per tensor, one list per column.

    Columns are stacked and moved to the host once each at flush.
    """

    __slots__ = ("cols", "counts", "deferred", "host", "kind", "means")

    def __init__(self, kind: int) -> None:
        self.kind = kind
        width = 1 if kind == _G_SCALAR else 2 if kind == _G_BOOL else 3 if kind == _G_COMPLEX else 4
        self.cols: list[list[torch.Tensor]] = [[] for _ in range(width)]
        self.counts: list[int] = []
        # (row, private copy, kind) of small tensors whose statistics are computed at flush
        self.deferred: list[tuple[int, torch.Tensor, int]] = []
        self.host: list[list[Any]] = []
        self.means: list[Any] = []

    def resolve(self) -> None:
        cols = self.cols
        n = len(cols[0])
        if not n:
            return
        # (column, rows, 1-d values): the rows reduced as they were seen, then those reduced here together
        pieces: list[tuple[int, list[int], torch.Tensor]] = []
        for index, col in enumerate(cols):
            rows = [r for r, value in enumerate(col) if value is not None]
            if rows:
                values = col if len(rows) == n else [col[r] for r in rows]
                pieces.append((index, rows, _stack(values)))
        pieces.extend(self._resolve_deferred())
        # one concatenation and one transfer per dtype among the columns
        by_dtype: dict[torch.dtype, list[tuple[int, list[int], torch.Tensor]]] = {}
        for piece in pieces:
            by_dtype.setdefault(piece[2].dtype, []).append(piece)
        host: list[list[Any]] = [[None] * n for _ in cols]
        for members in by_dtype.values():
            flat = _cat([_reshape(values, (-1,)) for _, _, values in members]).tolist()
            at = 0
            for index, rows, _ in members:
                column = host[index]
                for row, value in zip(rows, flat[at : at + len(rows)]):
                    column[row] = value
                at += len(rows)
        self.host = host
        if self.kind in (_G_NUMERIC, _G_COMPLEX):
            # torch.mean is sum / numel in the sum's dtype (the sums' dtypes promoted, as stacking them does)
            sums = host[2]
            dtype = functools.reduce(torch.promote_types, {v.dtype for i, _, v in pieces if i == 2})
            if dtype is torch.float64:  # Python's division is float64's
                self.means = [s / c for s, c in zip(sums, self.counts)]
            else:
                counts = _as_tensor(self.counts, dtype=dtype)
                self.means = _div(_as_tensor(sums, dtype=dtype), counts).tolist()

    def _resolve_deferred(self) -> list[tuple[int, list[int], torch.Tensor]]:
        """Statistics of the small tensors copied at capture: tensors of one shape are reduced together, row by
        row (the same reduction, bitwise, as one tensor at a time), so a step's many tiny tensors cost a few
        operators instead of four each. Returns (column, rows, values) pieces."""
        by_shape: dict[tuple[Any, int], list[tuple[int, torch.Tensor]]] = {}
        for row, copy, kind in self.deferred:
            by_shape.setdefault((copy.shape, kind), []).append((row, copy))
        self.deferred = []
        pieces: list[tuple[int, list[int], torch.Tensor]] = []
        for (_, kind), members in by_shape.items():
            rows = [row for row, _ in members]
            if len(members) == 1 or kind not in (K_F32, K_F64, K_LOW):
                for row, copy in members:
                    for index, value in enumerate(numeric(copy, kind)):
                        if value is not None:
                            pieces.append((index, [row], _reshape(value, (1,))))
                continue
            stacked = _reshape(_stack([copy for _, copy in members]), (len(members), -1))
            for index, values in enumerate(numeric_rows(stacked, kind)):
                pieces.append((index, rows, values))
        return pieces


_Ref = tuple[_Group, int] | None


class StatEngine:
    """Builds tensor items for one step and resolves their statistics at :meth:`flush`.

    ``md5``: add a CRC32 of each tensor, from a snapshot taken when the item is built. ``tensor_sink``: when
    given (task ``tensor``), it receives ``(data_name, snapshot)`` for every tensor item, the snapshot being a
    contiguous copy taken at that moment (so later in-place changes do not reach the file); a sink that returns
    False refuses the tensor (the dump reached its size limit) and gets no more of this step.
    """

    def __init__(
        self,
        md5: bool = False,
        tensor_sink: Callable[[str, torch.Tensor], bool | None] | None = None,
        cache_size: int = 64,
        worker_init: Callable[[], None] | None = None,
    ) -> None:
        self.md5 = md5
        self.worker_init = worker_init
        self.tensor_sink = tensor_sink
        self._groups: dict[tuple[torch.dtype, torch.device, bool], _Group] = {}
        self._pending: list[tuple[dict[str, Any], tuple[_Group, int]]] = []
        self._pending_crc: list[tuple[dict[str, Any], Future[str]]] = []
        # id(tensor) -> (weak reference to it, version, statistics reference, crc, snapshot); weak, because
        # holding gradients and activations alive would stop the allocator from reusing their memory
        self._cache: dict[int, tuple[Any, int, _Ref, str | Future[str] | None, torch.Tensor | None]] = {}
        self._cache_size = cache_size
        self.computed = 0  # tensors whose statistics were computed (the others came from the cache)

    # -- building items -------------------------------------------------------------------------------------

    def item(self, t: torch.Tensor, data_name: str | None = None, remember: bool = False) -> dict[str, Any]:
        """The JSON item of tensor ``t``; its statistics are filled in at :meth:`flush`.

        ``remember``: keep the results for a later item of the same, unchanged tensor (use it for outputs and
        gradients, never for inputs that an operator may change without bumping ``_version``, such as
        batch_norm's running statistics).
        """
        tp = type(t)
        if (tp is not _Tensor and tp is not _Parameter) or t.is_nested or t.layout is not _STRIDED:
            return self._special_item(t, data_name)
        item: dict[str, Any] = {
            "type": "torch.Tensor",
            "dtype": _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype),
            "shape": list(t.shape),
            "Max": None,
            "Min": None,
            "Mean": None,
            "Norm": None,
            "requires_grad": t.requires_grad,
        }
        key = id(t)
        hit = self._cache.get(key)
        version = -1 if t.is_inference() else t._version  # inference tensors have no version counter
        if version < 0:
            remember = False
        crc: str | Future[str] | None
        snap: torch.Tensor | None
        if hit is not None and hit[0]() is t and hit[1] == version:
            ref, crc, snap = hit[2], hit[3], hit[4]
        else:
            snap = None
            crc = None
            on_cpu = t.device.type == "cpu"
            if self.tensor_sink is not None or (self.md5 and not on_cpu):
                # a private copy, taken now: later in-place changes cannot reach the file or the CRC
                snap = _clone(_detach(t), memory_format=torch.contiguous_format)
            ref = self._compute(t, snap)
            if self.md5 and not t.is_meta:
                # CPU tensors right away, from their own bytes (no copy: it would cost about as much as the CRC);
                # device tensors from their copy, moved to the host and hashed on a worker thread
                if on_cpu:
                    try:
                        crc = crc32_hex(t)
                    except RuntimeError:  # no plain bytes to hash (a quantized dtype, say): no CRC
                        crc = None
                elif snap is not None:
                    crc = _crc_pool(self.worker_init).submit(crc32_hex, snap)
            if remember and self._cache_size:
                cache = self._cache
                if len(cache) >= self._cache_size:
                    del cache[next(iter(cache))]
                cache[key] = (_weakref(t), version, ref, crc, snap)
        if ref is not None:
            self._pending.append((item, ref))
        if self.md5:
            if isinstance(crc, str) or crc is None:
                item["md5"] = crc
            else:
                item["md5"] = None
                self._pending_crc.append((item, crc))
        if self.tensor_sink is not None and data_name is not None and snap is not None:
            if self.tensor_sink(data_name, snap) is False:
                self.tensor_sink = None  # the dump is full: no more copies, no data_name without a file
            else:
                item["data_name"] = data_name
        return item

    def _special_item(self, t: torch.Tensor, data_name: str | None) -> dict[str, Any]:
        """Items of tensors off the fast path: subclasses, sparse and nested tensors.

        A DTensor is described by its local shard, as msprobe does; a sparse tensor gets the statistics of its
        dense equivalent; tensors without data of their own (fake or functional tensors) and nested ones get no
        statistics (their metadata only), and a copy is saved when tensors are, where the layout allows one.
        """
        tp = type(t)
        local = getattr(t, "to_local", None)
        if local is not None and tp.__name__ == "DTensor":
            item = self.item(local(), data_name)
            item["type"] = "torch.distributed.tensor.DTensor"
            return item
        plain_data = not t.is_nested and t.layout is _STRIDED
        if (
            tp is not _Tensor
            and tp is not _Parameter
            and plain_data
            and not tp.__module__.startswith("torch._")
        ):
            # a user's subclass: its data are ordinary; only its __torch_function__ would see our operators
            item = self.item(t.as_subclass(_Tensor), data_name)
            item["requires_grad"] = t.requires_grad
            return item
        try:
            shape: Any = list(t.shape)
        except RuntimeError:  # nested tensors have no single shape
            shape = None
        item = {
            "type": "torch.Tensor",
            "dtype": dtype_name(t.dtype),
            "shape": shape,
            "Max": None,
            "Min": None,
            "Mean": None,
            "Norm": None,
            "requires_grad": t.requires_grad,
        }
        if t.layout is not _STRIDED and not t.is_nested:
            ref = self._sparse(t)
            if ref is not None:
                self._pending.append((item, ref))
        if self.md5:
            item["md5"] = None
        if self.tensor_sink is not None and data_name is not None and not t.is_nested:
            try:
                copy = _clone(_detach(t))
            except RuntimeError:
                return item
            if not tp.__module__.startswith("torch._"):
                if self.tensor_sink(data_name, copy) is False:
                    self.tensor_sink = None
                else:
                    item["data_name"] = data_name
        return item

    def _sparse(self, t: torch.Tensor) -> _Ref:
        """The statistics of a sparse tensor's dense equivalent, from its stored values: the implicit zeros
        count in Max and Min and in the Mean's divisor, and add nothing to the sum or the norm."""
        if t.is_meta:
            return None
        try:
            data = _detach(t)
            # COO: duplicates of one position add up; compressed layouts (CSR, CSC, BSR, BSC) hold each once
            coo = data.layout is torch.sparse_coo
            values = _reshape(data.coalesce()._values() if coo else data.values(), (-1,))
            if values.numel() < t.numel():
                values = _cat((values, _zeros(1, dtype=values.dtype, device=values.device)))
        except Exception:  # a layout or device without these operators: no statistics
            return None
        return self._compute(values, count=t.numel())

    def _group(self, t: torch.Tensor, kind: int, scalar: bool) -> _Group:
        key = (t.dtype, t.device, scalar)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(_G_SCALAR if scalar else kind)
        return group

    def _compute(self, t: torch.Tensor, copy: torch.Tensor | None = None, count: int | None = None) -> _Ref:
        """Launch the statistics of ``t`` (no host sync); returns a reference resolved at flush.

        ``copy``: a private copy of ``t`` already taken, used instead of a new one where one is needed.
        ``count``: the number of elements the Mean divides by, when ``t`` holds the values of a larger tensor.
        """
        dtype = t.dtype
        kind = KINDS.get(dtype)
        if kind is None:
            kind = KINDS[dtype] = kind_of(dtype)
        if t.layout is not _STRIDED or t.is_meta:
            return None
        if kind == K_NONE:
            if not t.is_quantized:
                return None
            t, kind, copy = t.dequantize(), K_F32, None  # a quantized tensor: the values it stands for
        numel = t.numel()
        if numel == 0:
            return None
        grad_was = torch.is_grad_enabled()
        try:  # inside: a cut right after switching grad off still switches it back
            if grad_was:
                torch._C._set_grad_enabled(False)
            return self._launch(t, kind, numel if count is None else count, copy)
        except Exception:  # an operator this device/dtype lacks: no statistics, but training goes on
            return None
        finally:
            if grad_was:
                torch._C._set_grad_enabled(True)

    def _launch(self, t: torch.Tensor, kind: int, numel: int, copy: torch.Tensor | None) -> _Ref:
        self.computed += 1
        if kind == K_BOOL:
            group = self._group(t, _G_BOOL, False)
            mn, mx = _aminmax(t)  # max = any, min = all
            cols = group.cols
            cols[0].append(mx)
            cols[1].append(mn)
            return group, len(cols[0]) - 1
        if t.dim() == 0:
            group = self._group(t, _G_SCALAR, True)
            col = group.cols[0]
            # a copy: the value may be changed in place later (num_batches_tracked)
            col.append(_clone(t) if copy is None else copy)
            return group, len(col) - 1
        group = self._group(t, _G_COMPLEX if kind == K_COMPLEX else _G_NUMERIC, False)
        cols = group.cols
        row = len(cols[0])
        group.counts.append(numel)
        if numel <= SMALL:
            # small tensors: one copy now, the statistics at flush (on the writer thread); for a handful of
            # elements the operators' fixed cost is the whole cost, so this saves most of it
            group.deferred.append((row, _clone(t) if copy is None else copy, kind))
            for col in cols:
                col.append(None)  # type: ignore[arg-type]
            return group, row
        mx, mn, s, norm = numeric(t, kind)
        cols[0].append(mx)
        cols[1].append(mn)
        cols[2].append(s)
        if norm is not None:
            cols[3].append(norm)
        return group, row

    # -- resolving --------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Move every group to the host (one transfer per column) and fill the items built so far."""
        for group in self._groups.values():
            group.resolve()
        for item, (group, row) in self._pending:
            host = group.host
            kind = group.kind
            if kind == _G_SCALAR:
                value = host[0][row]
                item["Max"] = item["Min"] = item["Mean"] = item["Norm"] = value
                continue
            item["Max"] = host[0][row]
            item["Min"] = host[1][row]
            if kind == _G_NUMERIC:
                item["Mean"] = group.means[row]
                item["Norm"] = host[3][row]
            elif kind == _G_COMPLEX:
                item["Mean"] = group.means[row]
        for item, job in self._pending_crc:
            item["md5"] = job.result()
        # everything built so far is resolved: start afresh (a later start() in the same step adds to the items)
        self._pending.clear()
        self._pending_crc.clear()
        self._groups.clear()
        self._cache.clear()

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop the cached results of these tensors: they were changed in a way their version does not show."""
        cache = self._cache
        if cache:
            for t in tensors:
                cache.pop(id(t), None)

    def clear_cache(self) -> None:
        """Drop the reuse cache (and the tensors it keeps alive)."""
        self._cache.clear()
