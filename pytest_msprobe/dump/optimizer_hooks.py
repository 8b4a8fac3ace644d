"""The optimizer in the records: its steps' parent node (level mix) and each parameter's update (optimizer.json).

APIs run inside ``optimizer.step()`` get the parent node "optimizer" in construct.json at level mix, as msprobe
gives them. At every level, each step of an optimizer holding the model's parameters also records, per parameter,
the weight and its gradient before the step and the weight and its optimizer state after it, in msprobe's record
shape under ``Optimizer.{parameter}.{n}.forward`` (see :mod:`pytest_msprobe.format.optimizerfile`): torch's optimizers
make other calls on other devices (single-tensor loops, ``torch._foreach_*`` lists, one fused kernel), and these
records let a compare pair the updates whatever kernels made them. The tensors go through the step's StatEngine,
as every record's do: statistics on the device, no host sync per parameter, md5 and tensor files alike.

The hooks are torch's global optimizer-step hooks, so they see every optimizer of every thread: only the owner
thread's steps count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.stack import Stack, StackTable
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.step_records import StepRecords
from pytest_msprobe.dump.threads import untracked
from pytest_msprobe.format.names import OPTIMIZER_NODE
from pytest_msprobe.format.optimizerfile import FOREACH, FUSED, SINGLE_TENSOR, OptimizerStep, update_name

_get_ident = threading.get_ident
_Tensor = torch.Tensor


class _Step:
    """An optimizer step under way: its updates' records, filled in by the post-hook."""

    __slots__ = ("calls", "cls", "implementation", "optimizer", "params", "previous", "records", "stack")

    def __init__(self, optimizer: Any, previous: str | None, stack: Stack) -> None:
        self.optimizer = optimizer
        self.cls = type(optimizer).__name__
        self.implementation = implementation(optimizer)
        self.previous = previous  # the last record made before the step (None: the step's first)
        self.stack = stack
        self.params: list[tuple[str, Any]] = []  # (update name, parameter)
        self.records: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []


class OptimizerHooks(StepRecords):
    """The recorder's part that notes when an optimizer's step runs, and what it did to each parameter."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        self._optimizer_hooked = False
        # the updates are recorded beside every dump but overflow_check's, which keeps overflowing calls only
        self.record_updates = not config.overflow_check
        # the model whose parameters count (None: every optimizer's), asked at each step: found late without one
        self.model_lookup: Callable[[], torch.nn.Module | None] | None = None
        self.optimizer_steps: list[_Step] = []
        self._running: list[_Step] = []  # steps begun and not ended (an optimizer stepping another)
        self._update_counts: dict[str, int] = {}
        self._optimizer_stacks = StackTable()

    def attach_optimizer_hooks(self) -> None:
        """Hook every optimizer's step: the parent node of the APIs it runs (mix), its parameters' updates."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # noted before registering: a cut in between leaves a hook for detach() to sweep
        self._optimizer_hooked = True
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.closed or _get_ident() != self.owner:  # optimizer hooks are global: other threads' too
            return
        if self.with_api_parents:
            self.construct.setdefault(OPTIMIZER_NODE, None)
        self.in_optimizer = True
        if self.record_updates:
            self.guarded(untracked, self._begin_updates, optimizer)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _get_ident() != self.owner:
            return
        running = self._running
        step = running.pop() if running and running[-1].optimizer is optimizer else None
        self.in_optimizer = bool(running)
        if step is None or self.closed:
            return
        self.guarded(untracked, self._end_updates, step)

    def _begin_updates(self, optimizer: Any) -> None:
        groups = getattr(optimizer, "param_groups", None) or []
        model = self.model_lookup() if self.model_lookup is not None else None
        names: dict[int, str] = {}
        if model is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            if not any(id(p) in names for group in groups for p in group.get("params", ())):
                return  # another model's optimizer
        previous = next(reversed(self.data), None) if self.data else None
        step = _Step(optimizer, previous, self.stacks.capture(2))
        counts = self._update_counts
        analyze, save = self.analyze, self.names
        for g, group in enumerate(groups):
            for k, p in enumerate(group.get("params", ())):
                grad = getattr(p, "grad", None)
                if grad is None:  # not updated: torch's optimizers skip it
                    continue
                parameter = names.get(id(p)) or f"group{g}.param{k}"
                n = counts.get(parameter, 0)
                counts[parameter] = n + 1
                name = update_name(parameter, n)
                step.params.append((name, p))
                self.engine.forget(
                    (p, grad)
                )  # (written by a fused kernel of an earlier step: see _end_updates)
                step.records[name] = {
                    "input_kwargs": {
                        "param": analyze(p, f"{name}.input.param" if save else None, False),
                        "grad": analyze(grad, f"{name}.input.grad" if save else None, False),
                    }
                }
        self._running.append(step)

    def _end_updates(self, step: _Step) -> None:
        state = getattr(step.optimizer, "state", None) or {}
        analyze, save, forget = self.analyze, self.names, self.engine.forget
        for name, p in step.params:
            held = state.get(p) if hasattr(state, "get") else None
            tensors = {
                str(k): v for k, v in (held or {}).items() if isinstance(v, _Tensor) and str(k) != "param"
            }
            # a fused kernel writes the weight and its state without bumping their versions: statistics cached
            # for them earlier in the step (a state tensor as torch.empty_like gave it out) would be stale
            forget([p, *tensors.values()])
            output = {"param": analyze(p, f"{name}.output.param" if save else None, True)}
            for key, value in tensors.items():
                output[key] = analyze(value, f"{name}.output.{key}" if save else None, True)
            step.records[name]["output"] = output
        # the records made inside the step: those after the last one made before it (records are added as
        # calls end, and no earlier call ends inside the step)
        names = list(self.data)
        start = names.index(step.previous) + 1 if step.previous in self.data else 0
        step.calls = names[start:]
        self._optimizer_stacks.add(str(len(self.optimizer_steps)), step.stack)
        self.optimizer_steps.append(step)

    def optimizer_document(self, data: dict[str, Any]) -> list[OptimizerStep]:
        """The steps for optimizer.json, once the statistics are resolved: ``data`` is dump.json's records (the
        position of each step is counted in it)."""
        stacks: dict[str, tuple[str, ...]] = {}
        for names, lines in self._optimizer_stacks.render().values():
            for key in names:
                stacks[key] = tuple(lines)
        order = {name: i for i, name in enumerate(data)}
        out = []
        for i, step in enumerate(self.optimizer_steps):
            calls = tuple(c for c in step.calls if c in order)
            if calls:
                position = order[calls[0]]
            elif step.previous is not None and step.previous in order:
                position = order[step.previous] + 1
            else:
                position = 0
            out.append(
                OptimizerStep(
                    step.cls, step.implementation, position, calls, stacks.get(str(i), ()), step.records
                )
            )
        return out

    def _finish_optimizer(self) -> None:
        """A step whose optimizer step never ended (it raised) records no update: its records would be half."""
        self._running.clear()
        self.in_optimizer = False

    def _sweep_optimizer(self) -> None:
        """Remove this recorder's global optimizer hooks, those whose handle was lost too."""
        if not self._optimizer_hooked:
            return
        from torch.optim import optimizer as optim_module

        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            hooks = getattr(optim_module, name, None)
            if hooks:
                for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is self]:
                    hooks.pop(key, None)


def implementation(optimizer: Any) -> str:
    """How an optimizer's step runs, as torch resolves it: ``fused`` (a fused flag, or a class outside torch.optim,
    such as torch_npu's fused optimizers), ``foreach`` (``torch._foreach_*`` over lists: the flag, or its default
    on CUDA), else ``single-tensor``; the first param group's."""
    if not any(
        c.__module__.startswith("torch.optim") and c.__name__ != "Optimizer" for c in type(optimizer).__mro__
    ):
        return FUSED
    groups = getattr(optimizer, "param_groups", None) or []
    if not groups:
        return SINGLE_TENSOR
    group = groups[0]
    if group.get("fused"):
        return FUSED
    foreach = group.get("foreach", False)
    if foreach is None:  # torch's default: by the devices and types of the parameters being updated
        params = [p for p in group.get("params", ()) if getattr(p, "grad", None) is not None]
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable", False)), False)[1]
        except (ImportError, TypeError, RuntimeError):  # another torch: its default on the CPU
            foreach = False
        lr = group.get("lr")
        if foreach and type(optimizer).__name__.startswith("Adam") and isinstance(lr, _Tensor):
            foreach = bool(group.get("capturable", False))  # Adam's family: a tensor lr single-tensor
    return FOREACH if foreach else SINGLE_TENSOR
