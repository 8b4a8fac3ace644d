"""Capture of one step: the records of APIs (L1) and modules (L0), forward and backward.

**APIs.** The wrappers of :mod:`.intercept` hand each call to :meth:`Recorder.api_call`, which records the inputs
(before the call: in-place operators change them), the outputs and the call stack.

**API backward.** After a captured call, a hook is put on the autograd node of each distinct output
(``out.grad_fn.register_hook``): its ``grad_outputs`` are the record's ``backward.input`` (gradients flowing in)
and its ``grad_inputs`` the record's ``backward.output`` (``null`` where undefined), which is what msprobe writes.
An output whose node is one an input already had before the call (``x.float()`` on a float tensor,
``contiguous()`` returning ``self``) gets no backward record: that node belongs to an earlier call.

**Modules (L0).** Forward pre-hooks record the inputs (before the module runs, so in-place modules are seen
as called), forward hooks the outputs and the module's own parameters. The module's backward record takes the
gradients of its outputs from hooks on their nodes, and, for each tensor input, the gradient flowing from this
module into it: the hooks sit on the module's own nodes that consume the input (found by walking the autograd
graph created during the call). That is the per-call gradient msprobe records through torch's full backward
hooks, without their identity node, so ``nn.ReLU(inplace=True)`` keeps its backward record. Parameter
gradients come from ``register_post_accumulate_grad_hook``; their ``parameters_grad`` key is reserved right
after the module's forward record, as msprobe orders them. They are recorded when the backward pass ends (a
final callback of the autograd engine, queued so that it runs after those queued during the pass): under
``DistributedDataParallel`` that is after the reducer has written the all-reduced gradients into ``.grad``.

**Collectives.** The wrappers of ``torch.distributed`` hand each call to :meth:`Recorder.dist_call`; what its
record holds and when is told in :mod:`.collectives`.

**Threads.** A recorder belongs to the thread that started it (``owner``). API calls reach it through that
thread's slot in :mod:`.intercept`; its module hooks, optimizer hooks and parameter-gradient hooks return at once
on any other thread, except on a thread Python did not create (an autograd device thread) while it runs a backward
pass this recorder claimed. The hooks it put on autograd nodes are its own whatever thread the engine runs them
on; the first of them to run on another thread claims that backward pass (:func:`.intercept.claim_backward`).

**Interruptions.** A ``KeyboardInterrupt`` (or any exception that is not an ``Exception``: ``SystemExit``, a test
timeout) passing through the recorder's code may leave a record half-built; the recorder then marks itself
``broken``, and the debugger drops the step instead of writing it. Ordinary exceptions raised by the wrapped
functions (a shape error the program catches) leave the records whole and change nothing. After ``closed``, every
hook and wrapper reaching the recorder returns without touching it.

No gradient or activation is kept alive by the capture beyond the hook that records it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pytest_msprobe.dump.analyze import analyze_other
from pytest_msprobe.dump.collectives import (
    P2POp,
    PendingCollective,
    collective_tensors,
    iter_tensors,
    p2p_fields,
    works_of,
)
from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.intercept import (
    _tls,
    claim_backward,
    is_foreign_thread,
    owns_backward,
    release_backward,
)
from pytest_msprobe.dump.stack import StackTable, capture_stack
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.format.names import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_NODE,
    CallCounter,
    backward_of,
    module_base,
    params_grad_name,
    scope_key,
    selected_by_list,
)

_Tensor = torch.Tensor
_AccumulateGrad: Any = torch._C._functions.AccumulateGrad
_get_sequence_nr: Callable[[], int] = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)
_add = torch._C._VariableFunctions.add
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_get_ident = threading.get_ident


def _queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (raises outside of one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- selection ----------------------------------------------------------------------------------------------------


class _Selector:
    """``list``, ``scope`` and ``data_mode`` filters, applied to record names as they are made."""

    def __init__(self, config: DumpConfig) -> None:
        self.items = config.api_list
        modes = config.data_mode
        self.fwd_in = "forward" in modes and "input" in modes
        self.fwd_out = "forward" in modes and "output" in modes
        self.bwd_in = "backward" in modes and "input" in modes
        self.bwd_out = "backward" in modes and "output" in modes
        self.forward = self.fwd_in or self.fwd_out
        self.backward = self.bwd_in or self.bwd_out
        self.scope_start: str | None = None
        self.scope_end: str | None = None
        if config.scope:
            self.scope_start = scope_key(config.scope[0])
            self.scope_end = scope_key(config.scope[-1])
        # before, inside or after the scope range
        self._inside = not config.scope
        self._done = False

    def enter(self, forward_name: str) -> bool:
        """Called when a forward record begins: whether it lies in the scope range."""
        if self._inside:
            return True
        if not self._done and scope_key(forward_name) == self.scope_start:
            self._inside = True
            return True
        return False

    def leave(self, forward_name: str) -> None:
        """Called when a forward record ends: the range closes after its last record."""
        if self.scope_end is not None and self._inside and scope_key(forward_name) == self.scope_end:
            self._inside = False
            self._done = True

    def listed(self, name: str) -> bool:
        return not self.items or selected_by_list(name, self.items)


# -- backward records ---------------------------------------------------------------------------------------------


class _ApiBackward:
    """Backward record of one API call, filled by hooks on the autograd nodes of its outputs."""

    __slots__ = ("dump_in", "dump_out", "name", "parent", "parts", "recorder", "want")

    def __init__(self, recorder: Recorder, name: str, parent: str | None, n_nodes: int) -> None:
        self.recorder = recorder
        self.name = name
        self.parent = parent
        self.want = n_nodes
        self.parts: list[tuple[tuple[Any, ...], tuple[Any, ...]] | None] = [None] * n_nodes

    def hook(self, index: int) -> Callable[[Any, Any], None]:
        def on_node(grad_inputs: Any, grad_outputs: Any) -> None:
            recorder = self.recorder
            if recorder.closed:
                return
            if _get_ident() != recorder.owner:
                claim_backward(recorder)
            try:
                self.parts[index] = (tuple(grad_outputs), tuple(grad_inputs))
                self.want -= 1
                if self.want == 0:
                    recorder.emit_api_backward(self)
            except BaseException as exc:
                recorder.interrupted(exc)
                raise

        return on_node


class _ModuleCall:
    """Forward state of one module call, kept on the module stack until its forward hook."""

    __slots__ = ("entry", "fwd", "input_keys", "parent", "seq", "stack", "wanted_bwd", "wanted_fwd")

    def __init__(self) -> None:
        self.fwd = ""
        self.parent: str | None = None
        self.entry: dict[str, Any] | None = None
        self.seq = 0
        # per tensor input that requires grad: (its grad_fn, or the leaf tensor itself; output_nr; position)
        self.input_keys: list[tuple[Any, int, int]] = []
        self.stack: Any = None
        self.wanted_fwd = False
        self.wanted_bwd = False


class _ModuleBackward:
    """Backward record of one module call: gradients of its outputs in, per-call gradients of its inputs out."""

    __slots__ = ("done", "grads_in", "grads_out", "name", "parent", "pending", "recorder")

    def __init__(
        self, recorder: Recorder, name: str, parent: str | None, n_outputs: int, n_inputs: int
    ) -> None:
        self.recorder = recorder
        self.name = name
        self.parent = parent
        self.grads_in: list[Any] = [None] * n_outputs  # gradients w.r.t. the module's outputs
        # contributions to the gradient of each positional input (inputs needing none stay null); no input
        # needing a gradient gives an empty list, as msprobe writes
        self.grads_out: list[list[Any]] = [[] for _ in range(n_inputs)]
        self.pending = 0  # node hooks still to fire
        self.done = False

    def output_hook(self, slots: list[tuple[int, int]]) -> Callable[[Any, Any], None]:
        def take(grad_inputs: Any, grad_outputs: Any) -> None:
            for position, output_nr in slots:
                self.grads_in[position] = grad_outputs[output_nr]

        return self._node_hook(take)

    def consumer_hook(self, slots: list[tuple[int, int]]) -> Callable[[Any, Any], None]:
        def take(grad_inputs: Any, grad_outputs: Any) -> None:
            for edge_index, position in slots:
                grad = grad_inputs[edge_index]
                if grad is not None:
                    self.grads_out[position].append(grad)

        return self._node_hook(take)

    def _node_hook(self, take: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """An autograd node hook that hands the node's gradients to ``take``, then counts the node as arrived."""

        def on_node(grad_inputs: Any, grad_outputs: Any) -> None:
            recorder = self.recorder
            if recorder.closed:
                return
            if _get_ident() != recorder.owner:
                claim_backward(recorder)
            try:
                take(grad_inputs, grad_outputs)
                self._arrived()
            except BaseException as exc:
                recorder.interrupted(exc)
                raise

        return on_node

    def _arrived(self) -> None:
        self.pending -= 1
        if self.pending == 0 and not self.done:
            self.recorder.emit_module_backward(self)


class _ParamsHook:
    """The post-accumulate-grad hook of one parameter (a class, so that a sweep can tell it is ours)."""

    __slots__ = ("pg", "pname", "recorder")

    def __init__(self, recorder: Recorder, pg: str, pname: str) -> None:
        self.recorder = recorder
        self.pg = pg
        self.pname = pname

    def __call__(self, param: torch.Tensor) -> None:
        recorder = self.recorder
        if recorder.closed or param.grad is None or not recorder._params_grad_ok.get(self.pg):
            return
        if _get_ident() != recorder.owner and not recorder.foreign_mine():
            return  # another thread's backward pass
        try:
            recorder.grad_accumulated(self.pg, self.pname, param)
        except BaseException as exc:
            recorder.interrupted(exc)
            raise


# -- the recorder -------------------------------------------------------------------------------------------------


class Recorder:
    """Everything captured in one step: records, stacks, module tree; flushed by the debugger on stop."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        self.config = config
        self.engine = engine
        self.data: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self.stacks = StackTable()
        self.counter = CallCounter()
        self.select = _Selector(config)
        self.names = config.save_tensors  # build data_name paths only when tensors are saved
        self.filtered = bool(config.scope or config.api_list)
        self.with_construct = config.modules
        self.with_api_parents = config.level == "mix"
        self.module_stack: list[_ModuleCall] = []
        self.in_optimizer = False
        self.closed = False
        # an interruption cut through the capture: the records may be half-built, the step is not written
        self.broken = False
        self.owner = _get_ident()  # the thread whose step this is (set again by the debugger's start)
        self._handles: list[Any] = []
        # what to sweep if a hook's handle was lost (an interruption between registering it and keeping it)
        self._model: torch.nn.Module | None = None
        self._hooks_kept = True
        self._optimizer_hooked = False
        self._api_pending: list[_ApiBackward] = []
        self._module_pending: list[_ModuleBackward] = []
        self._module_info: dict[int, tuple[str, list[tuple[str, torch.nn.Parameter]]]] = {}
        self._params_grad_ok: dict[str, bool] = {}
        # parameters whose gradient this backward pass accumulated, recorded when it ends
        self._grads_due: dict[tuple[str, str], torch.Tensor] = {}
        self._grads_queued = False
        # asynchronous collectives waiting for their work objects, by id of the work
        self.dist_pending: dict[int, PendingCollective] = {}

    # -- helpers ------------------------------------------------------------------------------------------------

    def interrupted(self, exc: BaseException) -> None:
        """An exception passed through the recorder's code: if it was an interruption, the records are not whole."""
        if not isinstance(exc, Exception):
            self.broken = True

    def foreign_mine(self) -> bool:
        """Whether the calling thread, not the owner, is a device thread running a backward pass of this step."""
        return is_foreign_thread() and owns_backward(self)

    def _parent(self) -> str | None:
        if self.module_stack:
            return self.module_stack[-1].fwd
        if self.in_optimizer:
            return OPTIMIZER_NODE
        return None

    def analyze(self, value: Any, name: str | None, remember: bool) -> Any:
        """msprobe's JSON form of one argument / output value (tensors through the StatEngine)."""
        if isinstance(value, _Tensor):
            return self.engine.item(value, name + ".pt" if name is not None else None, remember)
        if value is None:
            return None
        tp = type(value)
        if tp is bool:
            return {"type": "bool", "value": value}
        if tp is int or tp is float or tp is str:
            return {"type": tp.__name__, "value": value}
        if tp is torch.Size:
            return {"type": "torch.Size", "value": [int(v) for v in value]}
        if isinstance(value, (tuple, list)):
            fields = getattr(value, "_fields", None)
            if fields is not None and isinstance(value, tuple):
                return {
                    f: self.analyze(getattr(value, f), None if name is None else f"{name}.{f}", remember)
                    for f in fields
                }
            if name is None:
                return [self.analyze(v, None, remember) for v in value]
            return [self.analyze(v, f"{name}.{i}", remember) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {
                k: self.analyze(v, None if name is None else f"{name}.{k}", remember)
                for k, v in value.items()
            }
        if P2POp is not None and isinstance(value, P2POp):
            return {
                "class_type": "torch.distributed.P2POp",
                "tensor": self.analyze(value.tensor, name, remember),
                **p2p_fields(value),
            }
        return analyze_other(value)

    def _analyze_args(self, args: tuple[Any, ...], kwargs: dict[str, Any], prefix: str | None) -> Any:
        if prefix is None:
            return (
                [self.analyze(a, None, False) for a in args],
                {k: self.analyze(v, None, False) for k, v in kwargs.items()},
            )
        return (
            [self.analyze(a, f"{prefix}.{i}", False) for i, a in enumerate(args)],
            {k: self.analyze(v, f"{prefix}.{k}", False) for k, v in kwargs.items()},
        )

    def _analyze_out(self, output: Any, prefix: str | None) -> list[Any]:
        # as msprobe: a tuple output is listed item by item, anything else is one item
        if isinstance(output, tuple) and getattr(output, "_fields", None) is None:
            if prefix is None:
                return [self.analyze(v, None, True) for v in output]
            return [self.analyze(v, f"{prefix}.{i}", True) for i, v in enumerate(output)]
        return [self.analyze(output, None if prefix is None else f"{prefix}.0", True)]

    # -- APIs ---------------------------------------------------------------------------------------------------

    def api_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.closed:  # a thread's slot still naming a recorder that was stopped elsewhere
            return orig(*args, **kwargs)
        tls = _tls
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
            parent = self._parent() if self.with_api_parents else None
            grad = _is_grad_enabled()
            entry: dict[str, Any] | None = None
            stack: Any = None
            if want_fwd:
                entry = {}
                if select.fwd_in:
                    try:
                        if grad:
                            _set_grad_enabled(False)
                        prefix = f"{fwd}.input" if self.names else None
                        entry["input_args"], entry["input_kwargs"] = self._analyze_args(args, kwargs, prefix)
                    finally:
                        if grad:
                            _set_grad_enabled(True)
                stack = capture_stack(2)
            before = _input_nodes(args, kwargs) if want_bwd and grad else None
            out = orig(*args, **kwargs)
            if entry is not None:
                if select.fwd_out:
                    try:
                        if grad:
                            _set_grad_enabled(False)
                        entry["output"] = self._analyze_out(out, f"{fwd}.output" if self.names else None)
                    finally:
                        if grad:
                            _set_grad_enabled(True)
                self.data[fwd] = entry
                self.stacks.add(fwd, stack)
                if self.with_api_parents:
                    self.construct[fwd] = parent
            if before is not None:
                self._hook_api_backward(f"{api}.{index}.{BACKWARD}", parent, out, before)
            if self.filtered:
                select.leave(fwd)
            return out
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.broken = True
            raise
        finally:
            tls.active = prev

    def _hook_api_backward(self, bwd: str, parent: str | None, out: Any, before: list[Any]) -> None:
        if isinstance(out, _Tensor):  # the common case: one output tensor
            node = out.grad_fn
            if node is None:
                return
            for prior in before:
                if node is prior:
                    return
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
                return
        record = _ApiBackward(self, bwd, None if parent is None else _backward_parent(parent), len(nodes))
        for i, node in enumerate(nodes):
            self._handles.append(node.register_hook(record.hook(i)))
        if len(nodes) > 1:
            self._api_pending.append(record)

    def emit_api_backward(self, record: _ApiBackward) -> None:
        if record.name in self.data:
            return
        tls = _tls
        prev = tls.active
        try:
            tls.active = None
            grads_in: list[Any] = []
            grads_out: list[Any] = []
            for part in record.parts:
                if part is not None:
                    grads_in.extend(part[0])
                    grads_out.extend(part[1])
            # let the gradients go: kept alive, they would stop the engine from reusing their memory
            record.parts = [None] * len(record.parts)
            self._write_backward(record.name, record.parent, grads_in, grads_out)
        finally:
            tls.active = prev

    def _write_backward(
        self, name: str, parent: str | None, grads_in: list[Any], grads_out: list[Any]
    ) -> None:
        select = self.select
        entry: dict[str, Any] = {}
        names = self.names
        if select.bwd_in:
            entry["input"] = [
                self.analyze(g, f"{name}.input.{i}" if names else None, True) for i, g in enumerate(grads_in)
            ]
        if select.bwd_out:
            entry["output"] = [
                self.analyze(g, f"{name}.output.{i}" if names else None, True)
                for i, g in enumerate(grads_out)
            ]
        self.data[name] = entry
        if self.with_construct and (self.with_api_parents or name.startswith("Module.")):
            self.construct[name] = parent

    # -- modules ------------------------------------------------------------------------------------------------

    def attach_model(self, model: torch.nn.Module) -> None:
        """Hook every submodule of ``model`` (the model itself is not recorded, as in msprobe)."""
        # noted before the first hook: cut while hooking, detach() sweeps the model for hooks whose handle is lost
        self._model = model
        self._hooks_kept = False
        for path, module in model.named_modules():
            if not path:
                continue
            base = module_base(path, type(module).__name__)
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            self._module_info[id(module)] = (base, params)
            self._handles.append(module.register_forward_pre_hook(self._module_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._module_post, with_kwargs=True))
            if self.select.backward:
                for pname, param in params:
                    hook = _ParamsHook(self, params_grad_name(base), pname)
                    self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._hooks_kept = True

    def _module_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        info = self._module_info.get(id(module))
        if info is None or self.closed:
            return
        if _get_ident() != self.owner and not self.foreign_mine():
            return  # another thread runs the model
        tls = _tls
        prev = tls.active
        try:
            tls.active = None
            base = info[0]
            index = self.counter.next(base)
            call = _ModuleCall()
            call.fwd = fwd = f"{base}.{FORWARD}.{index}"
            call.parent = self._parent()
            select = self.select
            in_scope = select.enter(fwd)
            call.wanted_fwd = in_scope and select.forward and select.listed(fwd)
            call.wanted_bwd = (
                in_scope
                and select.backward
                and select.listed(f"{base}.{BACKWARD}.{index}")
                and _is_grad_enabled()
            )
            if call.wanted_fwd or call.wanted_bwd:
                self.construct[fwd] = call.parent
            if call.wanted_fwd:
                entry: dict[str, Any] = {}
                if select.fwd_in:
                    prefix = f"{fwd}.input" if self.names else None
                    entry["input_args"], entry["input_kwargs"] = self._analyze_args(args, kwargs, prefix)
                call.entry = entry
                call.stack = capture_stack(3)
            if call.wanted_bwd:
                call.seq = _get_sequence_nr()
                for position, arg in enumerate(args):
                    if isinstance(arg, _Tensor) and arg.requires_grad:
                        node = arg.grad_fn
                        if node is None:
                            call.input_keys.append((arg, 0, position))
                        else:
                            call.input_keys.append((node, arg.output_nr, position))
            self.module_stack.append(call)
        except BaseException as exc:
            self.interrupted(exc)
            raise
        finally:
            tls.active = prev

    def _module_post(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        info = self._module_info.get(id(module))
        if info is None or self.closed or not self.module_stack:
            return
        if _get_ident() != self.owner and not self.foreign_mine():
            return
        tls = _tls
        prev = tls.active
        try:
            tls.active = None
            call = self.module_stack.pop()
            base, params = info
            fwd = call.fwd
            if call.entry is not None:
                entry = call.entry
                if self.select.fwd_out:
                    entry["output"] = self._analyze_out(output, f"{fwd}.output" if self.names else None)
                prefix = f"{fwd}.parameters" if self.names else None
                entry["parameters"] = {
                    n: self.analyze(p, None if prefix is None else f"{prefix}.{n}", False)
                    for n, p in module.named_parameters(recurse=False)
                }
                self.data[fwd] = entry
                self.stacks.add(fwd, call.stack)
            if params and self.select.backward:
                pg = params_grad_name(base)
                if pg not in self.data and self.select.listed(pg) and (call.wanted_fwd or call.wanted_bwd):
                    # reserved here, in declaration order, and filled when the gradients are accumulated
                    self.data[pg] = dict.fromkeys(n for n, _ in params)
                    self._params_grad_ok[pg] = True
            if call.wanted_bwd:
                self._hook_module_backward(call, output, len(args))
            self.select.leave(fwd)
        except BaseException as exc:
            self.interrupted(exc)
            raise
        finally:
            tls.active = prev

    def _hook_module_backward(self, call: _ModuleCall, output: Any, n_args: int) -> None:
        n_outputs = len(output) if isinstance(output, (tuple, list)) else 1
        out_nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for position, t in _iter_top_tensors(output):
            node = t.grad_fn
            if node is None:
                continue
            slot = out_nodes.get(id(node))
            if slot is None:
                out_nodes[id(node)] = (node, [(position, t.output_nr)])
            else:
                slot[1].append((position, t.output_nr))
        if not out_nodes:
            return
        record = _ModuleBackward(
            self,
            backward_of(call.fwd),
            None if call.parent is None else _backward_parent(call.parent),
            n_outputs,
            n_args if call.input_keys else 0,
        )
        consumers = _find_consumers([n for n, _ in out_nodes.values()], call.input_keys, call.seq)
        record.pending = len(out_nodes) + len(consumers)
        for node, slots in out_nodes.values():
            self._handles.append(node.register_hook(record.output_hook(slots)))
        for node, slots in consumers:
            self._handles.append(node.register_hook(record.consumer_hook(slots)))
        self._module_pending.append(record)

    def emit_module_backward(self, record: _ModuleBackward) -> None:
        if record.done:
            return
        record.done = True
        tls = _tls
        prev_active = tls.active
        prev = _is_grad_enabled()
        try:
            tls.active = None
            _set_grad_enabled(False)
            grads_out: list[Any] = []
            for contributions in record.grads_out:
                if not contributions:
                    grads_out.append(None)
                    continue
                total = contributions[0]
                for more in contributions[1:]:
                    total = _add(total, more)
                grads_out.append(total)
            grads_in = record.grads_in
            record.grads_in = []  # let the gradients go once recorded
            record.grads_out = []
            self._write_backward(record.name, record.parent, grads_in, grads_out)
        finally:
            _set_grad_enabled(prev)
            tls.active = prev_active

    def grad_accumulated(self, pg: str, pname: str, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: record it when the backward pass ends."""
        self._grads_due[(pg, pname)] = param
        if self._grads_queued:
            return
        try:
            _queue_callback(self._at_backward_end)
        except RuntimeError:  # not inside a backward pass of the engine: record it now
            self._record_grads()
        else:
            self._grads_queued = True

    def _at_backward_end(self) -> None:
        # the final callbacks run in the order they were queued: this one was queued at the first accumulated
        # gradient, before those queued later in the pass (DDP's reducer queues its finalisation when its last
        # bucket is ready); queued again now, it runs after all of them
        try:
            _queue_callback(self._grads_at_end)
        except RuntimeError:  # pragma: no cover - the engine accepts callbacks while running them
            self._grads_at_end()

    def _grads_at_end(self) -> None:
        if self.closed:  # stopped meanwhile: finish() recorded them
            self._grads_queued = False
            return
        try:
            self._record_grads()
        except BaseException as exc:
            self.interrupted(exc)
            raise

    def _record_grads(self) -> None:
        """Record the gradients of the parameters accumulated by the backward pass (``parameters_grad``)."""
        self._grads_queued = False
        due, self._grads_due = self._grads_due, {}
        if not due:
            return
        tls = _tls
        prev = tls.active
        try:
            tls.active = None
            for (pg, pname), param in due.items():
                grad = param.grad
                if grad is None:
                    continue
                self.engine.forget((grad,))  # reduced in place by a collective, its version unchanged
                entry = self.data.get(pg)
                if entry is None:
                    entry = self.data[pg] = {}
                name = f"{pg}.{pname}" if self.names else None
                entry[pname] = [self.analyze(grad, name, False)]
        finally:
            tls.active = prev

    # -- torch.distributed --------------------------------------------------------------------------------------

    def dist_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record a collective or point-to-point call (see :mod:`.collectives`)."""
        if self.closed:
            return orig(*args, **kwargs)
        tls = _tls
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
                grad = _is_grad_enabled()
                try:
                    if grad:
                        _set_grad_enabled(False)
                    prefix = f"{fwd}.input" if self.names else None
                    entry["input_args"], entry["input_kwargs"] = self._analyze_args(args, kwargs, prefix)
                finally:
                    if grad:
                        _set_grad_enabled(True)
            stack = capture_stack(2)
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
        tls = _tls
        prev_active = tls.active
        prev = _is_grad_enabled()
        try:
            tls.active = None
            _set_grad_enabled(False)
            self.engine.forget(collective_tensors(pending.args, pending.kwargs))
            entry["output"] = self._collective_output(pending.name, pending.args, pending.kwargs)
        except BaseException as exc:
            self.interrupted(exc)
            raise
        finally:
            _set_grad_enabled(prev)
            tls.active = prev_active

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

    # -- optimizer ----------------------------------------------------------------------------------------------

    def attach_optimizer_hooks(self) -> None:
        """APIs run inside ``optimizer.step()`` get the parent node "optimizer" in construct.json (mix)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # noted before registering: a cut in between leaves a hook for detach() to sweep
        self._optimizer_hooked = True
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.closed and _get_ident() == self.owner:  # optimizer hooks are global: other threads' too
            self.construct.setdefault(OPTIMIZER_NODE, None)
            self.in_optimizer = True

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _get_ident() == self.owner:
            self.in_optimizer = False

    # -- end of capture -----------------------------------------------------------------------------------------

    def detach(self, sweep: bool = False) -> None:
        """Remove every hook this recorder registered (module, node, parameter and optimizer hooks); idempotent.

        ``sweep`` (or a hooking that was cut short) also looks through the model's modules and parameters and the
        optimizer's global hooks for hooks of this recorder whose handle was never kept. A node hook whose handle
        was lost that way stays on its node, and does nothing once the recorder is closed.
        """
        for handle in self._handles:  # remove() is idempotent: cut here, the next detach() goes on
            handle.remove()
        self._handles.clear()
        if sweep or not self._hooks_kept:
            self._sweep()
        release_backward(self)

    def _sweep(self) -> None:
        model = self._model
        if model is not None:
            for module in model.modules():
                d = module.__dict__
                for attr, extras in (
                    ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
                    ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
                ):
                    hooks = d.get(attr)
                    if not hooks:
                        continue
                    for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is self]:
                        hooks.pop(key, None)
                        for extra in extras:
                            more = d.get(extra)
                            if more:
                                more.pop(key, None)
                for param in module.parameters(recurse=False):
                    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
                    if hooks:
                        for key in [
                            k
                            for k, fn in hooks.items()
                            if isinstance(fn, _ParamsHook) and fn.recorder is self
                        ]:
                            hooks.pop(key, None)
            self._hooks_kept = True
        if self._optimizer_hooked:
            from torch.optim import optimizer as optim_module

            for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
                hooks = getattr(optim_module, name, None)
                if hooks:
                    for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is self]:
                        hooks.pop(key, None)

    def finish(self) -> None:
        """Write out the backward records still incomplete and drop empty reservations."""
        try:
            self._finish()
        except BaseException as exc:
            self.interrupted(exc)
            raise

    def _finish(self) -> None:
        self._record_grads()  # a backward pass that did not reach its end (it raised) still accumulated them
        self.dist_pending.clear()  # never waited for: those records keep their inputs only
        for api_record in self._api_pending:
            if api_record.name not in self.data and any(p is not None for p in api_record.parts):
                self.emit_api_backward(api_record)
        self._api_pending.clear()
        for module_record in self._module_pending:
            arrived = any(g is not None for g in module_record.grads_in) or any(module_record.grads_out)
            if not module_record.done and arrived:
                self.emit_module_backward(module_record)
        self._module_pending.clear()
        for key in self._params_grad_ok:
            entry = self.data.get(key)
            if entry is None:
                continue
            for pname in [n for n, v in entry.items() if v is None]:
                del entry[pname]  # no gradient arrived (not used in this step's loss)
            if not entry:
                del self.data[key]
        self.module_stack.clear()
        self.in_optimizer = False


def _backward_parent(parent: str) -> str | None:
    if parent == OPTIMIZER_NODE:
        return None
    return backward_of(parent)


def _iter_top_tensors(value: Any) -> Iterable[tuple[int, torch.Tensor]]:
    """(position, tensor) at the top level of a module output: the tensor itself, or those of a tuple/list."""
    if isinstance(value, _Tensor):
        yield 0, value
    elif isinstance(value, (tuple, list)):
        for position, v in enumerate(value):
            if isinstance(v, _Tensor):
                yield position, v


def _input_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The autograd nodes the tensor arguments of a call have before it runs."""
    nodes = []
    for a in args:
        if isinstance(a, _Tensor):
            node = a.grad_fn
            if node is not None:
                nodes.append(node)
        elif isinstance(a, (tuple, list)):
            for t in iter_tensors(a):
                node = t.grad_fn
                if node is not None:
                    nodes.append(node)
    if kwargs:
        for t in iter_tensors(kwargs):
            node = t.grad_fn
            if node is not None:
                nodes.append(node)
    return nodes


def _find_consumers(
    out_nodes: list[Any], input_keys: list[tuple[Any, int, int]], seq: int
) -> list[tuple[Any, list[tuple[int, int]]]]:
    """Nodes created during a module call that take a gradient edge to one of its inputs.

    ``input_keys``: (the input's grad_fn and output_nr, or the leaf tensor itself; position) per tensor input
    that requires grad. Only nodes whose sequence number is at least ``seq`` (created after the pre-hook) are
    walked, so the walk stays within the module's own part of the graph. Returns
    ``(node, [(edge index, input position), ...])`` pairs.
    """
    if not input_keys:
        return []
    edges: dict[tuple[int, int], int] = {}
    leaves: dict[int, int] = {}
    keep_alive = []
    for key, output_nr, position in input_keys:
        keep_alive.append(key)
        if isinstance(key, _Tensor):
            leaves[id(key)] = position
        else:
            edges[(id(key), output_nr)] = position
    found: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    seen: set[int] = set()
    todo = [n for n in out_nodes if _seq(n) >= seq and type(n) is not _AccumulateGrad]
    for n in todo:
        seen.add(id(n))
    while todo:
        node = todo.pop()
        for edge_index, (nxt, output_nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if type(nxt) is _AccumulateGrad:
                hit = leaves.get(id(nxt.variable)) if leaves else None
            else:
                hit = edges.get((id(nxt), output_nr))
            if hit is not None:
                slot = found.get(id(node))
                if slot is None:
                    found[id(node)] = (node, [(edge_index, hit)])
                else:
                    slot[1].append((edge_index, hit))
                continue
            key = id(nxt)
            if key in seen or type(nxt) is _AccumulateGrad or _seq(nxt) < seq:
                continue
            seen.add(key)
            todo.append(nxt)
    return list(found.values())


def _seq(node: Any) -> int:
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError):
        return 0
