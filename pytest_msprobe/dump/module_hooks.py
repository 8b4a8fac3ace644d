"""The records of modules (L0): forward and backward hooks of every submodule, and its ``parameters_grad``.

Forward pre-hooks record the inputs (before the module runs, so in-place modules are seen as called), forward
hooks the outputs and the module's own parameters. The module's backward record takes the gradients of its
outputs from hooks on their nodes, and, for each tensor input, the gradient flowing from this module into it: the
hooks sit on the module's own nodes that consume the input (found by walking the autograd graph created during
the call, :func:`.autograd.find_consumers`). That is the per-call gradient msprobe records through torch's full
backward hooks, without their identity node, so ``nn.ReLU(inplace=True)`` keeps its backward record.

Parameter gradients come from ``register_post_accumulate_grad_hook``; their ``parameters_grad`` key is reserved
right after the module's forward record, as msprobe orders them. They are recorded when the backward pass ends (a
final callback of the autograd engine, queued so that it runs after those queued during the pass): under
``DistributedDataParallel`` that is after the reducer has written the all-reduced gradients into ``.grad``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pytest_msprobe.dump.autograd import BackwardRecord, find_consumers, get_sequence_nr, queue_callback
from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.ops import add as _add
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.step_records import ModuleCall, StepRecords, backward_parent
from pytest_msprobe.dump.threads import slot, untracked
from pytest_msprobe.format.names import BACKWARD, FORWARD, backward_of, module_base, params_grad_name

_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_get_ident = threading.get_ident


class _ModuleBackward(BackwardRecord):
    """Backward record of one module call: gradients of its outputs in, per-call gradients of its inputs out."""

    __slots__ = ("done", "grads_in", "grads_out")

    def __init__(
        self, recorder: StepRecords, name: str, parent: str | None, n_outputs: int, n_inputs: int
    ) -> None:
        super().__init__(recorder, name, parent, 0)  # ``want`` is set once the nodes are known
        self.grads_in: list[Any] = [None] * n_outputs  # gradients w.r.t. the module's outputs
        # contributions to the gradient of each positional input (inputs needing none stay null); no input
        # needing a gradient gives an empty list, as msprobe writes
        self.grads_out: list[list[Any]] = [[] for _ in range(n_inputs)]
        self.done = False

    def output_hook(self, slots: list[tuple[int, int]]) -> Callable[[Any, Any], None]:
        def take(grad_inputs: Any, grad_outputs: Any) -> None:
            for position, output_nr in slots:
                self.grads_in[position] = grad_outputs[output_nr]

        return self.hook(0, take)

    def consumer_hook(self, slots: list[tuple[int, int]]) -> Callable[[Any, Any], None]:
        def take(grad_inputs: Any, grad_outputs: Any) -> None:
            for edge_index, position in slots:
                grad = grad_inputs[edge_index]
                if grad is not None:
                    self.grads_out[position].append(grad)

        return self.hook(0, take)

    def emit(self) -> None:
        if self.done:
            return
        self.done = True
        untracked(self._record)

    def _record(self) -> None:
        grads_out: list[Any] = []
        for contributions in self.grads_out:
            if not contributions:
                grads_out.append(None)
                continue
            total = contributions[0]
            for more in contributions[1:]:
                total = _add(total, more)
            grads_out.append(total)
        grads_in = self.grads_in
        self.grads_in = []  # let the gradients go once recorded
        self.grads_out = []
        self.recorder._write_backward(self.name, self.parent, grads_in, grads_out)


class _ParamsHook:
    """The post-accumulate-grad hook of one parameter (a class, so that a sweep can tell it is ours)."""

    __slots__ = ("pg", "pname", "recorder")

    def __init__(self, recorder: ModuleHooks, pg: str, pname: str) -> None:
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


class ModuleHooks(StepRecords):
    """The recorder's part that hooks a model's submodules and parameters."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        # what to sweep if a hook's handle was lost (an interruption between registering it and keeping it)
        self._model: torch.nn.Module | None = None
        self._hooks_kept = True
        self._module_pending: list[_ModuleBackward] = []
        self._module_info: dict[int, tuple[str, list[tuple[str, torch.nn.Parameter]]]] = {}
        self._params_grad_ok: dict[str, bool] = {}
        # parameters whose gradient this backward pass accumulated, recorded when it ends
        self._grads_due: dict[tuple[str, str], torch.Tensor] = {}
        self._grads_queued = False

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
        tls = slot
        prev = tls.active
        try:
            tls.active = None
            base = info[0]
            index = self.counter.next(base)
            call = ModuleCall()
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
                    entry["input_args"], entry["input_kwargs"] = self.analyze_inputs(fwd, args, kwargs, False)
                call.entry = entry
                call.stack = self.stacks.capture(3)
            if call.wanted_bwd:
                call.seq = get_sequence_nr()
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
        tls = slot
        prev = tls.active
        try:
            tls.active = None
            call = self.module_stack.pop()
            base, params = info
            fwd = call.fwd
            if call.entry is not None:
                entry = call.entry
                if self.select.fwd_out:
                    entry["output"] = self.analyze_output(fwd, output, False)
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
            self.select.leave(fwd)  # the forward record is whole: a scope range may close after it
            if call.wanted_bwd:
                self._hook_module_backward(call, output, len(args))
        except BaseException as exc:
            self.interrupted(exc)
            raise
        finally:
            tls.active = prev

    def _hook_module_backward(self, call: ModuleCall, output: Any, n_args: int) -> None:
        n_outputs = len(output) if isinstance(output, (tuple, list)) else 1
        out_nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for position, t in _iter_top_tensors(output):
            node = t.grad_fn
            if node is None:
                continue
            known = out_nodes.get(id(node))
            if known is None:
                out_nodes[id(node)] = (node, [(position, t.output_nr)])
            else:
                known[1].append((position, t.output_nr))
        if not out_nodes:
            return
        record = _ModuleBackward(
            self,
            backward_of(call.fwd),
            None if call.parent is None else backward_parent(call.parent),
            n_outputs,
            n_args if call.input_keys else 0,
        )
        consumers = find_consumers([n for n, _ in out_nodes.values()], call.input_keys, call.seq)
        record.want = len(out_nodes) + len(consumers)
        for node, slots in out_nodes.values():
            self._handles.append(node.register_hook(record.output_hook(slots)))
        for node, slots in consumers:
            self._handles.append(node.register_hook(record.consumer_hook(slots)))
        self._module_pending.append(record)

    def grad_accumulated(self, pg: str, pname: str, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: record it when the backward pass ends."""
        self._grads_due[(pg, pname)] = param
        if self._grads_queued:
            return
        try:
            queue_callback(self._at_backward_end)
        except RuntimeError:  # not inside a backward pass of the engine: record it now
            self._record_grads()
        else:
            self._grads_queued = True

    def _at_backward_end(self) -> None:
        # the final callbacks run in the order they were queued: this one was queued at the first accumulated
        # gradient, before those queued later in the pass (DDP's reducer queues its finalisation when its last
        # bucket is ready); queued again now, it runs after all of them
        try:
            queue_callback(self._grads_at_end)
        except RuntimeError:  # pragma: no cover - the engine accepts callbacks while running them
            self._grads_at_end()

    def _grads_at_end(self) -> None:
        if self.closed:  # stopped meanwhile: finish() recorded them
            self._grads_queued = False
            return
        self.guarded(self._record_grads)

    def _record_grads(self) -> None:
        """Record the gradients of the parameters accumulated by the backward pass (``parameters_grad``)."""
        self._grads_queued = False
        due, self._grads_due = self._grads_due, {}
        if not due:
            return
        tls = slot
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

    def _finish_modules(self) -> None:
        """At the end of capture: the backward records some of whose hooks fired, and ``parameters_grad``
        entries without the gradients that never came (parameters not used in this step's loss)."""
        for module_record in self._module_pending:
            arrived = any(g is not None for g in module_record.grads_in) or any(module_record.grads_out)
            if not module_record.done and arrived:
                module_record.emit()
        self._module_pending.clear()
        for key in self._params_grad_ok:
            entry = self.data.get(key)
            if entry is None:
                continue
            for pname in [n for n, v in entry.items() if v is None]:
                del entry[pname]
            if not entry:
                del self.data[key]

    def _sweep_model(self) -> None:
        """Remove this recorder's module and parameter hooks from the model, those whose handle was lost too."""
        model = self._model
        if model is None:
            return
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
                        k for k, fn in hooks.items() if isinstance(fn, _ParamsHook) and fn.recorder is self
                    ]:
                        hooks.pop(key, None)
        self._hooks_kept = True


def _iter_top_tensors(value: Any) -> Iterable[tuple[int, torch.Tensor]]:
    """(position, tensor) at the top level of a module output: the tensor itself, or those of a tuple/list."""
    if isinstance(value, _Tensor):
        yield 0, value
    elif isinstance(value, (tuple, list)):
        for position, v in enumerate(value):
            if isinstance(v, _Tensor):
                yield position, v
