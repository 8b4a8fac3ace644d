"""torch.distributed in the dump: what a collective's record holds, and when it is taken.

A collective is recorded as ``Distributed.<name>.<n>.forward`` (``Distributed.all_reduce.0.forward``):

- ``input_args`` / ``input_kwargs``: the arguments as passed, recorded before the call;
- ``output``: the positional arguments followed by the keyword values, recorded once the call is over. That is
  msprobe's form: collectives write into their arguments (``all_reduce`` reduces its tensor in place, ``all_gather``
  fills its list, ``recv`` its buffer), so ``output.0`` of an ``all_reduce`` is the reduced tensor, and the value the
  function returns (``None``, a work object, a rank) is not recorded.

An asynchronous collective (``async_op=True``, ``isend``, ``irecv``, ``batch_isend_irecv``) returns before its
tensors are final: its ``output`` is recorded when the program calls ``wait()`` on the work object it got (on the
last of them, for ``batch_isend_irecv``), which is when the program itself may read them. The dump never waits in
the program's place: a work that is not waited for before ``stop()`` (its future used instead, say) leaves the
record with its inputs only.

Process groups, reduce operations and ``P2POp`` objects are written as msprobe writes them (see
:mod:`.analyze`). Collectives write into tensors without advancing their version counter, so the statistics cache
forgets every tensor a collective touched.

The collectives with autograd of ``torch.distributed.nn.functional`` are recorded under the same
``Distributed.<name>`` (the plain collective they run inside is nested and not recorded again) and get a
``backward`` record from the autograd node of their output; the collective their backward runs is then recorded
as a forward call made during the backward pass, as any API called there is.

What is not seen: collectives issued from C++ never pass through these wrappers. That covers every gradient
all-reduce of ``DistributedDataParallel`` (its reducer buckets the gradients and all-reduces them itself), its
buffer broadcast, and the ``torch.distributed._functional_collectives`` used by compiled code and DTensor. What DDP
did shows in the parameter gradients, which are recorded after the reduction (see :mod:`.capture`). Nothing here
depends on the backend: gloo, nccl and hccl take the same path (with nccl and hccl a work's ``wait()`` orders the
device stream and the statistics are queued after it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pytest_msprobe.dump.analyze import group_id, group_ranks

try:
    import torch.distributed as _dist

    _AVAILABLE = _dist.is_available()
except ImportError:  # pragma: no cover - torch built without distributed support
    _AVAILABLE = False

_Work: Any = _dist.Work if _AVAILABLE else None
P2POp: Any = _dist.P2POp if _AVAILABLE else None
_Tensor = torch.Tensor


def works_of(result: Any) -> list[Any]:
    """The work objects an asynchronous collective returned (empty for a synchronous call)."""
    if _Work is None:
        return []
    if isinstance(result, _Work):
        return [result]
    if isinstance(result, list) and result and all(isinstance(w, _Work) for w in result):
        return result  # batch_isend_irecv
    return []


def collective_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Every tensor among a collective's arguments, in lists and ``P2POp`` objects included."""
    for value in args:
        yield from iter_tensors(value)
    for value in kwargs.values():
        yield from iter_tensors(value)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: itself, or within its lists, tuples, dicts and ``P2POp`` objects."""
    if isinstance(value, _Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif P2POp is not None and isinstance(value, P2POp):
        yield from iter_tensors(value.tensor)


def p2p_fields(op: Any) -> dict[str, Any]:
    """The fields of a ``P2POp`` other than its tensor, as msprobe writes them."""
    fields: dict[str, Any] = {
        "op": getattr(op.op, "__name__", str(op.op)),
        "peer": op.peer,
        "tag": op.tag,
    }
    ranks = group_ranks(op.group)
    if ranks is not None:
        fields["group_id"] = group_id(ranks)
    return fields


class PendingCollective:
    """An asynchronous collective's record, waiting for its work objects."""

    __slots__ = ("args", "kwargs", "left", "name", "works")

    def __init__(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], works: list[Any]) -> None:
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.works = works  # held, so that their ids stay theirs while they are looked up by id
        self.left = len(works)
