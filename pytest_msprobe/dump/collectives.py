"""torch.distributed in the dump: what a collective's record holds, and when it is taken.

The wrappers of ``torch.distributed`` (:mod:`.intercept`) hand each call to :meth:`Collectives.dist_call`.
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
:mod:`.entries`). Collectives write into tensors without advancing their version counter, so the statistics cache
forgets every tensor a collective touched.

The collectives with autograd of ``torch.distributed.nn.functional`` are recorded under the same
``Distributed.<name>`` (the plain collective they run inside is nested and not recorded again) and get a
``backward`` record from the autograd node of their output; the collective their backward runs is then recorded
as a forward call made during the backward pass, as any API called there is.

What is not seen: collectives issued from C++ never pass through these wrappers. That covers every gradient
all-reduce of ``DistributedDataParallel`` (its reducer buckets the gradients and all-reduces them itself), its
buffer broadcast, and the ``torch.distributed._functional_collectives`` used by compiled code and DTensor. What DDP
did shows in the parameter gradients, which are recorded after the reduction (see :mod:`.module_hooks`). Nothing here
depends on the backend: gloo, nccl and hccl take the same path (with nccl and hccl a work's ``wait()`` orders the
device stream and the statistics are queued after it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.entries import iter_tensors
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.step_records import StepRecords
from pytest_msprobe.dump.threads import slot, untracked
from pytest_msprobe.format.names import FORWARD

try:
    import torch.distributed as _dist

    _Work: Any = _dist.Work if _dist.is_available() else None
except ImportError:  # pragma: no cover - torch built without distributed support
    _Work = None
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


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


class PendingCollective:
    """An asynchronous collective's record, waiting for its work objects."""

    __slots__ = ("args", "kwargs", "left", "name", "works")

    def __init__(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], works: list[Any]) -> None:
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.works = works  # held, so that their ids stay theirs while they are looked up by id
        self.left = len(works)


class Collectives(StepRecords):
    """The recorder's part that records the calls of torch.distributed."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        # asynchronous collectives waiting for their work objects, by id of the work
        self.dist_pending: dict[int, PendingCollective] = {}

    def dist_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record a collective or point-to-point call, as this module's docstring tells."""
        __tracebackhide__ = True  # pytest shows the user's call, not the recorder, when the call raises
        if self.closed:
            return orig(*args, **kwargs)
        tls = slot
        prev = tls.active
        try:
            tls.active = None
            fwd = f"{api}.{self.counter.next(api)}.{FORWARD}"
            select = self.select
            wanted = select.forward
            if self.filtered:
                wanted = select.enter(fwd) and wanted and select.listed(fwd)
            if not wanted:
                out = orig(*args, **kwargs)
                self.engine.forget(collective_tensors(args, kwargs))
                if self.filtered:
                    select.leave(fwd)
                return out
            parent = self._parent() if self.with_api_parents else None
            entry: dict[str, Any] = {}
            if select.fwd_in:
                inputs = self.analyze_inputs(fwd, args, kwargs, _is_grad_enabled())
                entry["input_args"], entry["input_kwargs"] = inputs
            stack = self.stacks.capture(2)
            out = orig(*args, **kwargs)
            self.data[fwd] = entry
            self.stacks.add(fwd, stack)
            if self.with_api_parents:
                self.construct[fwd] = parent
            self.engine.forget(collective_tensors(args, kwargs))
            if select.fwd_out:
                works = works_of(out)
                if works:
                    pending = PendingCollective(fwd, args, kwargs, works)
                    for work in works:
                        self.dist_pending[id(work)] = pending
                else:
                    entry["output"] = self._collective_output(fwd, args, kwargs)
            if self.filtered:
                select.leave(fwd)
            return out
        except BaseException as exc:
            self.interrupted(exc)
            raise
        finally:
            tls.active = prev

    def work_waited(self, work: Any) -> None:
        """A work object was waited for: complete the record of its collective once all of its works are done."""
        pending = self.dist_pending.pop(id(work), None)
        if pending is None or self.closed:
            return
        pending.left -= 1
        if pending.left:
            return
        entry = self.data.get(pending.name)
        if entry is None:
            return
        self.guarded(untracked, self._complete, entry, pending)

    def _complete(self, entry: dict[str, Any], pending: PendingCollective) -> None:
        """The record of a waited collective, its tensors now final: their statistics taken anew."""
        self.engine.forget(collective_tensors(pending.args, pending.kwargs))
        entry["output"] = self._collective_output(pending.name, pending.args, pending.kwargs)

    def _collective_output(self, fwd: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """msprobe's ``output`` of a collective: its arguments after the call, positional then keyword values."""
        values = [*args, *kwargs.values()]
        grad = _is_grad_enabled()
        try:
            if grad:
                _set_grad_enabled(False)
            if not self.names:
                return [self.analyze(v, None, False) for v in values]
            return [self.analyze(v, f"{fwd}.output.{i}", False) for i, v in enumerate(values)]
        finally:
            if grad:
                _set_grad_enabled(True)
