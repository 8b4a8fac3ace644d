"""The records of API calls (L1): a forward record per call, and a backward record from hooks on its outputs.

The wrappers of :mod:`.intercept` hand each call to :meth:`ApiCalls.api_call`, which records the inputs (before
the call: in-place operators change them), the outputs and the call stack.

**Backward.** After a captured call, a hook is put on the autograd node of each distinct output
(``out.grad_fn.register_hook``): its ``grad_outputs`` are the record's ``backward.input`` (gradients flowing in)
and its ``grad_inputs`` the record's ``backward.output`` (``null`` where undefined), which is what msprobe writes.
An output whose node is one an input already had before the call (``x.float()`` on a float tensor,
``contiguous()`` returning ``self``) gets no backward record: that node belongs to an earlier call.

**Self-check** (``config.self_check``): the call's inputs are copied before it runs and the call is handed to
:class:`~pytest_msprobe.dump.online_self_check.SelfCheck` after, which replays and judges it; its backward record hands
the gradients in and out to it when written. Without it, the check costs one attribute read per call.

``api_call`` runs for every captured call, so it is written for speed: it makes no Python call beyond those its
record needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump.autograd import BackwardRecord, input_nodes
from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.entries import iter_tensors
from pytest_msprobe.dump.online_self_check import SelfCheck
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.step_records import StepRecords, backward_parent
from pytest_msprobe.dump.threads import slot
from pytest_msprobe.format.names import BACKWARD, FORWARD

_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled


class _ApiBackward(BackwardRecord):
    """Backward record of one API call: the gradients of its output nodes, in and out, node after node."""

    __slots__ = ()

    def emit(self) -> None:
        recorder = self.recorder
        if self.name in recorder.data:
            return
        tls = slot
        prev = tls.active
        try:
            tls.active = None
            grads_in: list[Any] = []
            grads_out: list[Any] = []
            for part in self.parts:
                if part is not None:
                    grads_in.extend(part[0])
                    grads_out.extend(part[1])
            # let the gradients go: kept alive, they would stop the engine from reusing their memory
            self.parts = [None] * len(self.parts)
            recorder._write_backward(self.name, self.parent, grads_in, grads_out)
            if recorder.self_check is not None:
                recorder.self_check.backward(self.name, grads_in, grads_out)
        finally:
            tls.active = prev


class ApiCalls(StepRecords):
    """The recorder's part that records API calls and their backward."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        # backward records of calls with several output nodes: written at finish() if some never fired
        self._api_pending: list[_ApiBackward] = []
        # called once with the first recorded call's name and inputs (the checklist's batch without a model)
        self.on_first_call: Callable[[str, tuple[Any, ...], dict[str, Any]], None] | None = None
        if config.self_check:
            self.self_check = SelfCheck(config)

    def api_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        __tracebackhide__ = True  # pytest shows the user's call, not the recorder, when the call raises
        if self.closed:  # a thread's slot still naming a recorder that was stopped elsewhere
            return orig(*args, **kwargs)
        tls = slot
        prev = tls.active
        try:
            tls.active = None  # calls nested in this one are not recorded
            counts = self.counter.counts
            index = counts.get(api, 0)
            counts[api] = index + 1
            fwd = f"{api}.{index}.{FORWARD}"
            select = self.select
            if self.filtered:
                in_scope = select.enter(fwd)
                want_fwd = in_scope and select.forward and select.listed(fwd)
                want_bwd = in_scope and select.backward and select.listed(f"{api}.{index}.{BACKWARD}")
                if not (want_fwd or want_bwd):
                    out = orig(*args, **kwargs)
                    select.leave(fwd)
                    return out
            else:
                want_fwd = select.forward
                want_bwd = select.backward
            if self.on_first_call is not None:
                first, self.on_first_call = self.on_first_call, None
                first(fwd, args, kwargs)
            parent = self._parent() if self.with_api_parents else None
            grad = _is_grad_enabled()
            entry: dict[str, Any] | None = None
            stack: Any = None
            if want_fwd:
                entry = {}
                if select.fwd_in:
                    entry["input_args"], entry["input_kwargs"] = self.analyze_inputs(fwd, args, kwargs, grad)
                stack = self.stacks.capture(2)
            before = input_nodes(args, kwargs) if want_bwd and grad else None
            check = self.self_check
            copied = None  # the inputs, copied before the call (in-place calls change them)
            if check is not None and (want_fwd or before is not None):
                copied = check.inputs(args, kwargs)
            out = orig(*args, **kwargs)
            if entry is not None:
                if select.fwd_out:
                    entry["output"] = self.analyze_output(fwd, out, grad)
                self.data[fwd] = entry
                self.stacks.add(fwd, stack)
                if self.with_api_parents:
                    self.construct[fwd] = parent
            bwd = None
            if before is not None:
                bwd = self._hook_api_backward(f"{api}.{index}.{BACKWARD}", parent, out, before)
            if check is not None and copied is not None:
                check.forward(api, fwd if want_fwd else None, bwd, copied, out)
            if self.filtered:
                select.leave(fwd)
            return out
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.broken = True
            raise
        finally:
            tls.active = prev

    def _hook_api_backward(self, bwd: str, parent: str | None, out: Any, before: list[Any]) -> str | None:
        """Hook the nodes of a call's outputs for its backward record ``bwd``; ``bwd`` when one will follow."""
        if isinstance(out, _Tensor):  # the common case: one output tensor
            node = out.grad_fn
            if node is None:
                return None
            for prior in before:
                if node is prior:
                    return None
            nodes = [node]
        else:
            nodes = []
            for t in iter_tensors(out):
                node = t.grad_fn
                if node is None:
                    continue
                if any(node is seen for seen in nodes) or any(node is prior for prior in before):
                    continue
                nodes.append(node)
            if not nodes:
                return None
        record = _ApiBackward(self, bwd, None if parent is None else backward_parent(parent), len(nodes))
        for i, node in enumerate(nodes):
            self._handles.append(node.register_hook(record.hook(i)))
        if len(nodes) > 1:
            self._api_pending.append(record)
        return bwd

    def _finish_api_backward(self) -> None:
        """Write the backward records some of whose nodes fired (the others never will in this step)."""
        for api_record in self._api_pending:
            if api_record.name not in self.data and any(p is not None for p in api_record.parts):
                api_record.emit()
        self._api_pending.clear()
