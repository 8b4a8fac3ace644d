"""A pytest plugin that injects one precision fault into a training test, chosen by ``INJECT_FAULT``:

    INJECT_FAULT=op:Functional.conv2d.30            pytest -p faults_plugin ...  # that call's output x (1 + 1e-3)
    INJECT_FAULT=backward:Functional.conv2d.32      pytest -p faults_plugin ...  # its backward x (1 + 1e-2)
    INJECT_FAULT=optimizer:layer3.3.conv2.weight    pytest -p faults_plugin ...  # + 1e-3 x std after each step
    INJECT_FAULT=op:Functional.relu.4@1             pytest -p faults_plugin ...  # at training step 1 only

(``bench/`` on ``PYTHONPATH``). Each stands for a broken device kernel, so the dump sees what a real one would
make, and nothing else changes:

- ``op``: the API (``Functional.*``, ``Torch.*`` or ``Tensor.*``, as the dump names it) is replaced for the session;
  its call number N of every step (the dump's own count, from 0, reset when the optimizer steps) runs the original
  and then multiplies the output in place through ``.data``, so the recorded call keeps its own autograd node and
  the tensors that node saved;
- ``backward``: that call's own autograd node computes its backward with an incoming gradient 1% too large
  (a hook on the node scales the gradients it gives out, which a backward's linearity makes the same thing): its
  backward record takes in the true gradient and gives out ones 1% off, its forward is untouched;
- ``optimizer``: a global optimizer-step post-hook adds ``1e-3 * std`` to the named parameter of the model (the
  first module run in the session, the model whose forward wraps the others) after every ``optimizer.step()``, as
  one parameter's faulty update would.

What the dump records in the step runs through torch's functions captured below, at import, before any
debugger wraps them: the fault's own arithmetic is never a recorded call. ``INJECT_FAULT_LOG=FILE`` writes each
firing as JSON (``[{"step": 0, "at": "Functional.conv2d.30.forward"}, ...]``), the ground truth the compare's
first divergence is held against; the terminal summary says the same. A fault that never fired makes the run
exit with pytest's usage-error status (4): its tests would otherwise pass for the wrong reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

_MUL = torch.mul
_MUL_ = torch.Tensor.mul_
_ADD_ = torch.Tensor.add_
_STD = torch.Tensor.std

ENV = "INJECT_FAULT"
LOG_ENV = "INJECT_FAULT_LOG"
OP_SCALE = 1e-3  # op fault: output x (1 + OP_SCALE)
GRAD_SCALE = 1e-2  # backward fault: incoming gradient x (1 + GRAD_SCALE)
UPDATE_SCALE = 1e-3  # optimizer fault: + UPDATE_SCALE * the weight's std
KINDS = ("op", "backward", "optimizer")
OWNERS: dict[str, Any] = {"Functional": F, "Torch": torch, "Tensor": torch.Tensor}


@dataclass(frozen=True)
class FaultSpec:
    """One fault: its kind and where: an API call (``Functional.conv2d.30``) or a parameter's name; ``step``:
    the one training step (from 0) it fires at, None for every step (``...@1`` in ``INJECT_FAULT``)."""

    kind: str
    target: str
    step: int | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        kind, _, where = text.strip().partition(":")
        target, at, step = where.partition("@")
        if kind not in KINDS or not target or (at and not step.isdigit()):
            raise pytest.UsageError(
                f"{ENV}={text!r}: expected op:API.N, backward:API.N or optimizer:PARAMETER, each optionally "
                "@STEP (e.g. op:Functional.conv2d.30, optimizer:layer1.0.conv1.weight@1)"
            )
        spec = cls(kind, target, int(step) if at else None)
        if kind != "optimizer":
            spec.call()  # checked now: a typo is a usage error, not a fault that never fires
        return spec

    def call(self) -> tuple[Any, str, int]:
        """The owner of the API, its attribute name and the call number: ``(F, "conv2d", 30)``."""
        prefix, _, rest = self.target.partition(".")
        attr, _, index = rest.rpartition(".")
        owner = OWNERS.get(prefix)
        if owner is None or not attr or not index.isdigit() or not callable(getattr(owner, attr, None)):
            raise pytest.UsageError(
                f"{ENV}={self.kind}:{self.target}: no such API call; expected PREFIX.NAME.N with PREFIX one of "
                f"{', '.join(OWNERS)} and NAME a function of it (e.g. Functional.linear.3)"
            )
        return owner, attr, int(index)


def _scaled_gradients(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A node hook: the gradients the node gives out, x (1 + GRAD_SCALE). A backward is linear in the gradient it
    takes in, so this is the node computing with an incoming gradient 1% too large, while the gradient recorded
    as arriving is the true one: a faulty backward kernel, the forward untouched."""
    return tuple(None if g is None else _MUL(g, 1.0 + GRAD_SCALE) for g in grad_inputs)


class Injector:
    """The installed fault: the patched API or the optimizer hook, the step count, and what fired."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.step = 0
        self.calls = 0
        self.fired: list[dict[str, Any]] = []
        self._undo: list[Callable[[], None]] = []
        self._model: torch.nn.Module | None = None
        self._param: torch.Tensor | None = None
        self._model_hook: Any = None

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # the step count: every fault fires per step, and the dump counts its calls per step
        self._undo.append(register_optimizer_step_post_hook(self._after_step).remove)
        if self.spec.kind == "optimizer":
            self._model_hook = register_module_forward_pre_hook(self._first_module)
            self._undo.append(self._model_hook.remove)
            return
        owner, attr, _ = self.spec.call()
        own = attr in vars(owner)
        original = getattr(owner, attr)
        setattr(owner, attr, self._patched(original))

        def undo() -> None:
            if own:
                setattr(owner, attr, original)
            else:  # inherited (a Tensor method from TensorBase): drop ours
                delattr(owner, attr)

        self._undo.append(undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patched(self, original: Callable[..., Any]) -> Callable[..., Any]:
        _, _, index = self.spec.call()
        backward = self.spec.kind == "backward"

        def faulty(*args: Any, **kwargs: Any) -> Any:
            n = self.calls
            self.calls += 1
            out = original(*args, **kwargs)
            if (
                n != index
                or not self._now()
                or not isinstance(out, torch.Tensor)
                or not out.is_floating_point()
            ):
                return out
            if backward:
                node = out.grad_fn
                if node is None:
                    return out
                # registered before the dump's own hook on the node (the dump hooks it once this returns), so
                # its backward record gives out the scaled gradients
                node.register_hook(_scaled_gradients)
                self._fired(f"{self.spec.target}.backward")
            else:
                # through .data: no version bump, so the call's own node (and what it saved) stays usable
                _MUL_(out.data, 1.0 + OP_SCALE)
                self._fired(f"{self.spec.target}.forward")
            return out

        faulty.__name__ = getattr(original, "__name__", "faulty")
        faulty.__doc__ = getattr(original, "__doc__", None)
        return faulty

    def _first_module(self, module: torch.nn.Module, args: Any) -> None:
        if self._model is None:  # the outermost forward starts first: the model
            self._model = module
        if self._model_hook is not None:  # a global hook slows every module call down: once is enough
            self._model_hook.remove()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.spec.kind == "optimizer" and self._now():
            param = self._parameter()
            with torch.no_grad():  # a 0-d std on the device: no host sync, no Python float to convert
                _ADD_(param, _STD(param), alpha=UPDATE_SCALE)
            self._fired(f"{self.spec.target} (after optimizer.step())")
        self.step += 1
        self.calls = 0

    def _parameter(self) -> torch.Tensor:
        if self._param is None:
            if self._model is None:
                raise RuntimeError(
                    f"{ENV}: optimizer.step() before any module ran: no model to find a weight in"
                )
            params = dict(self._model.named_parameters())
            if self.spec.target not in params:
                names = ", ".join(list(params)[:8])
                raise RuntimeError(
                    f"{ENV}=optimizer:{self.spec.target}: {type(self._model).__name__} has no such parameter "
                    f"(it has {names}, ...)"
                )
            self._param = params[self.spec.target]
        return self._param

    def _now(self) -> bool:
        """Whether the fault fires at this training step."""
        return self.spec.step is None or self.spec.step == self.step

    def _fired(self, at: str) -> None:
        self.fired.append({"step": self.step, "at": at})


_KEY = pytest.StashKey[Injector]()


def pytest_configure(config: pytest.Config) -> None:
    text = os.environ.get(ENV, "")
    if not text:
        return
    injector = Injector(FaultSpec.parse(text))
    injector.install()
    config.stash[_KEY] = injector


def pytest_report_header(config: pytest.Config) -> str | None:
    injector = config.stash.get(_KEY, None)
    return None if injector is None else f"injected fault: {injector.spec.kind} at {injector.spec.target}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    injector = config.stash.get(_KEY, None)
    if injector is None:
        return
    spec = f"{injector.spec.kind}:{injector.spec.target}"
    if not injector.fired:
        terminalreporter.write_line(f"injected fault {spec}: NEVER FIRED (no such call in a step?)", red=True)
        return
    steps = sorted({f["step"] for f in injector.fired})
    ats = sorted({f["at"] for f in injector.fired})
    terminalreporter.write_line(
        f"injected fault {spec}: fired {len(injector.fired)} time(s), steps {steps}, at {', '.join(ats)}"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    injector = session.config.stash.get(_KEY, None)
    if injector is not None and not injector.fired:  # whatever the tests did, they did not meet the fault
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


def pytest_unconfigure(config: pytest.Config) -> None:
    injector = config.stash.get(_KEY, None)
    if injector is None:
        return
    injector.uninstall()
    log = os.environ.get(LOG_ENV, "")
    if log:
        Path(log).write_text(json.dumps(injector.fired), encoding="utf-8")
