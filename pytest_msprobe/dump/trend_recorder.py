"""The trend of a training run: per step its loss, its global gradient norm and each module's, without a dump.

    recorder = TrendRecorder(steps=40)
    for x, y in batches:
        recorder.begin(model)
        loss = loss_fn(model(x), y)
        recorder.loss(loss)                   # the step's loss (the last value given in a step counts)
        loss.backward()
        optimizer.step()                      # the gradient norms are taken here, once the gradients are final
        recorder.end()                        # one host sync: every value of the step moves to the host at once

The gradient norms are taken when the gradients are final: at the first ``optimizer.step()`` of the step of an
optimizer that holds the model's parameters (torch's global optimizer-step pre-hook), else at the end of the
step. They are L2 norms: per parameter (accumulated in float32, float64 for float64 gradients), per module (the
module that owns the parameter in ``model.named_parameters()``, ``(model)`` for the model's own) and over the
whole model. The training dtype is the autocast dtype when autocast is on where the loss is given, else the loss
tensor's dtype, else the model's first floating parameter's. NaN and Inf are kept as they are.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.format.trendfile import TrendData, TrendStep

ROOT_MODULE = "(model)"  # the module name of the parameters the model holds itself


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast computes in where it is on (any device type), else None."""
    for device_type in ("cuda", "npu", "cpu", "xpu"):
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
        except (RuntimeError, TypeError, AttributeError):  # a device type this torch does not know
            continue
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TrendRecorder:
    """Records the first ``steps`` training steps of a model (see the module's docstring)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.recorded: list[TrendStep] = []
        self.dtype: str | None = None
        self.modules: tuple[str, ...] = ()
        self._model: torch.nn.Module | None = None
        self._params: list[torch.Tensor] = []
        self._index: torch.Tensor | None = None  # per parameter: its module's position in self.modules
        self._ids: frozenset[int] = frozenset()
        self._loss: Any = None
        self._norms: torch.Tensor | None = None
        self._hook: Any = None
        self._owner: int | None = None
        self._active = False
        self._param_dtype: str | None = None

    @property
    def step(self) -> int:
        """The step being recorded (or next to be)."""
        return len(self.recorded)

    @property
    def loss_given(self) -> bool:
        return self._loss is not None

    def begin(self, model: Any) -> None:
        """Start recording a step of ``model`` (a no-op once ``steps`` steps are recorded)."""
        if self.step >= self.steps:
            return
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                "trend_steps records the model's gradient norms: pass the model, msprobe.step(model)"
                + ("" if model is None else f" (got {type(model).__name__})")
            )
        if model is not self._model:
            self._take(model)
        self._loss, self._norms, self._active = None, None, True
        self._owner = threading.get_ident()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)

    def _take(self, model: torch.nn.Module) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        modules: dict[str, int] = {}
        index = []
        for name, _ in named:
            owner = name.rpartition(".")[0] or ROOT_MODULE
            index.append(modules.setdefault(owner, len(modules)))
        self._model = model
        self._params = [p for _, p in named]
        self._ids = frozenset(id(p) for p in self._params)
        self._index = torch.tensor(index, dtype=torch.long)
        if self.modules and tuple(modules) != self.modules:
            raise ConfigError("msprobe.step(model) was given another model than in the steps before")
        self.modules = tuple(modules)
        floating = next((p.dtype for p in self._params if p.is_floating_point()), None)
        self._param_dtype = _dtype_name(floating) if floating is not None else None

    def loss(self, value: Any) -> None:
        """The step's loss: a number or a one-element tensor (the last value given in a step counts; steps
        after the recorded ones are not recorded)."""
        if self.step >= self.steps:
            return
        if not self._active:
            raise ConfigError(
                "msprobe.loss() outside msprobe.step(): give the step's loss inside 'with msprobe.step(model):'"
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError(
                    f"msprobe.loss() takes the step's loss, one number; got a tensor of shape "
                    f"{list(value.shape)}"
                )
            if self.dtype is None:
                autocast = _autocast_dtype()
                self.dtype = _dtype_name(autocast if autocast is not None else value.dtype)
            self._loss = value.detach().reshape(())
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"msprobe.loss() takes a number or a one-element tensor, got {value!r}")
        if self.dtype is None:
            autocast = _autocast_dtype()
            self.dtype = _dtype_name(autocast) if autocast is not None else None
        self._loss = float(value)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active or self._norms is not None or threading.get_ident() != self._owner:
            return
        if any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"]):
            self._norms = self._grad_norms()

    def _grad_norms(self) -> torch.Tensor:
        """``[global, module...]`` on the device, no host sync."""
        assert self._index is not None
        grads = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        if not grads:
            return torch.zeros(1 + len(self.modules), dtype=torch.float64)
        wide = all(g.dtype == torch.float64 for _, g in grads)
        acc = torch.float64 if wide else torch.float32
        device = grads[0][1].device
        tensors = [g.detach() for _, g in grads]
        try:  # one fused kernel per device and dtype (torch's clip_grad_norm_ uses it too)
            parts = list(torch._foreach_norm(tensors, 2, dtype=acc))
        except (AttributeError, TypeError, RuntimeError):  # a torch without it, or a device it does not cover
            parts = [torch.linalg.vector_norm(g, dtype=acc) for g in tensors]
        norms = torch.stack([n.to(device) for n in parts])
        index = self._index[[i for i, _ in grads]].to(device)
        per_module = torch.zeros(len(self.modules), dtype=acc, device=device).index_add_(
            0, index, norms * norms
        )
        return torch.cat([per_module.sum().sqrt().reshape(1), per_module.sqrt()])

    def end(self) -> None:
        """Finish the step: its values move to the host (one sync). Raises ConfigError when no loss was given."""
        if not self._active:
            return
        self._close()
        if self._norms is None:
            self._norms = self._grad_norms()
        norms = self._norms
        loss = self._loss
        if loss is None:
            self._norms = None
            raise ConfigError(
                f"msprobe.loss() was not called in step {self.step}: the trend (trend_steps={self.steps}) "
                "compares each step's loss; call msprobe.loss(loss) inside each 'with msprobe.step(model):'"
            )
        if isinstance(loss, torch.Tensor):
            values = torch.cat([loss.to(device=norms.device, dtype=norms.dtype).reshape(1), norms]).tolist()
        else:
            values = [loss, *norms.tolist()]
        if self.dtype is None:
            self.dtype = self._param_dtype
        self.recorded.append(TrendStep(self.step, values[0], values[1], tuple(values[2:])))
        self._loss, self._norms = None, None

    def abort(self) -> None:
        """Give up the step being recorded (its body raised)."""
        self._close()
        self._loss, self._norms = None, None

    def _close(self) -> None:
        self._active = False
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    def data(self, rank: int | None = None) -> TrendData:
        """What was recorded, for :func:`pytest_msprobe.format.trendfile.write_trend`."""
        return TrendData(self.dtype, self.modules, tuple(self.recorded), rank)
