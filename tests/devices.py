"""Another device's numerics, simulated on the CPU for this project's own tests: one side of a run computes its
float32 convolutions and matrix products in TF32, as a CUDA GPU does, and declares it.

Use it from a test (``from tests.devices import Fault, simulated_tf32``, or the ``simulated_device`` fixture),
or load it as a pytest plugin in a pytester run (``-p tests.devices``), where ``--simulate-device=tf32`` (or
``tf32-undeclared``) and ``--simulate-fault=noise:Functional.relu:1`` put every test of the run under it.

What it changes, exactly, while it is active:

- **The kernels.** A ``TorchDispatchMode``, entered on the thread that starts the simulation (where the
  training and, on the CPU, its backward run), rounds float32 operands to TF32's 10 mantissa bits (to nearest,
  ties to even, as ``pytest_msprobe.replay.emulate.round_mantissa`` does) where they reach a kernel:
  ``aten.convolution`` (input, weight; the bias is added as it is), ``aten.convolution_backward`` (the
  incoming gradient, input, weight; the bias's gradient is summed from the incoming gradient as it came),
  ``aten.mm`` and ``aten.bmm`` (both operands), ``aten.addmm``/``baddbmm``/``addbmm`` and their in-place forms
  (the two multiplied, not the added input), and the CPU's fused attention and its backward (query, key,
  value; the incoming gradient). Backward matrix products are ``aten.mm``/``bmm`` calls too, so they read the
  incoming gradient and the saved operands rounded, as cuBLAS's backward kernels do under the switch. Other
  operators, and float64 ones (the self-check's replay), are left alone. The rounding calls aten's operators
  directly, as a kernel rounds without a call of torch's API: the dump records none of it.

  torch's functions are not replaced: ``F.conv2d``, ``F.linear``, ``torch.matmul``, ``Tensor.__matmul__`` are
  torch's own, the dump wraps and records them as usual, and each call's output keeps torch's own autograd
  node, as on a real device (a custom autograd Function in their place would give a node of its own, whose
  gradients are not those of addmm's node, bias first, nor of a 3-D linear's view, and whose backward records
  no replay could judge).
- **The declaration** (``declare=True``): ``pytest_msprobe.dump.switches.switches`` returns torch's switches
  with ``cudnn.allow_tf32`` and ``cuda.matmul.allow_tf32`` True (what the checklist records and the
  self-check's policy is read from), and ``pytest_msprobe.dump.switches.training_device`` returns ``"cuda"``
  (the device type the checklist records and the policy is read for), in the module the debugger in use
  reads them from (after in-process pytester runs, not always the one ``sys.modules`` holds). With
  ``declare=False`` the rounding is there and the run declares the CPU's float32, as a device that does not
  say what it computes in.
- **A fault** (``inject``, a :class:`Fault`): the torch function of its API (``F.relu``, ``F.conv2d``,
  ``torch.matmul``...) replaced by one that changes its output in place through ``.data`` (the op's own node
  stays) on the ``index``-th call of the API in each dumped step (the dump's own call counter, so the record it
  makes is ``{api}.{index}.forward``): ``noise``, the output times ``1 + 1e-3 N(0, 1)`` (a generator of its
  own: the training draws as without it); ``scale``, times 1.001. torch's own functions are captured for the
  replay first (``pytest_msprobe.replay.pristine``), so the replay runs torch's function, not the fault.

Everything is put back when the simulation ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pytest_msprobe
from pytest_msprobe.replay import pristine

TF32 = "tf32"
NOISE = 1e-3
SCALE = 1.001
_CONV_BACKWARD_MASK = 10  # convolution_backward's output_mask (grad_input, grad_weight, grad_bias)


def _operands() -> dict[Any, tuple[int, ...]]:
    aten = torch.ops.aten
    table = {
        aten.convolution.default: (0, 1),
        aten.convolution_backward.default: (0, 1, 2),
        aten.mm.default: (0, 1),
        aten.bmm.default: (0, 1),
        aten.addmm.default: (1, 2),
        aten.addmm_.default: (1, 2),
        aten.baddbmm.default: (1, 2),
        aten.baddbmm_.default: (1, 2),
        aten.addbmm.default: (1, 2),
        aten.addbmm_.default: (1, 2),
    }
    for name, positions in (
        ("_scaled_dot_product_flash_attention_for_cpu", (0, 1, 2)),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", (0, 1, 2, 3)),
    ):
        packet = getattr(aten, name, None)
        if packet is not None:
            table[packet.default] = positions
    return table


def tf32(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor rounded to TF32 (10 mantissa bits, to nearest, ties to even), through aten's operators
    alone: add 0xfff plus the lowest bit kept to the bits, then clear the 13 dropped ones. Inf and NaN stay."""
    aten = torch.ops.aten
    raw = aten.view.dtype(aten.clone.default(t, memory_format=torch.contiguous_format), torch.int32)
    lowest_kept = aten.bitwise_and.Scalar(aten.bitwise_right_shift.Tensor_Scalar(raw, 13), 1)
    rounded = aten.bitwise_and.Scalar(aten.add.Tensor(aten.add.Tensor(raw, 0xFFF), lowest_kept), ~0x1FFF)
    out = aten.view.dtype(rounded, torch.float32)
    return aten.where.self(aten.isfinite.default(t), out, t)


class TF32Kernels(TorchDispatchMode):
    """float32 operands of convolutions and matrix products rounded to TF32 where a kernel reads them;
    ``rounded`` counts the kernel calls it rounded for."""

    def __init__(self) -> None:
        super().__init__()
        self.operands = _operands()
        self.rounded = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        positions = self.operands.get(func)
        if positions is None or not any(_is_f32(args[i]) for i in positions if i < len(args)):
            return func(*args, **kwargs)
        self.rounded += 1
        rounded = list(args)
        for i in positions:
            if _is_f32(rounded[i]):
                rounded[i] = tf32(rounded[i])
        if func is not torch.ops.aten.convolution_backward.default or not args[_CONV_BACKWARD_MASK][2]:
            return func(*rounded, **kwargs)
        # the bias's gradient is a sum of the incoming gradient as it came (no tensor core reads it)
        mask = list(args[_CONV_BACKWARD_MASK])
        rounded[_CONV_BACKWARD_MASK] = [mask[0], mask[1], False]
        grad_input, grad_weight, _ = func(*rounded, **kwargs)
        plain = list(args)
        plain[_CONV_BACKWARD_MASK] = [False, False, True]
        return grad_input, grad_weight, func(*plain, **kwargs)[2]


def _is_f32(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


@dataclass(frozen=True)
class Fault:
    """An op fault: ``kind`` ``noise`` (output x (1 + 1e-3 N(0,1))) or ``scale`` (x 1.001) on the ``index``-th
    call of ``api`` (``Functional.relu``, ``Torch.matmul``, ``Tensor.__matmul__``) in each dumped step."""

    kind: str
    api: str
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``noise:Functional.relu:1`` -> ``Fault("noise", "Functional.relu", 1)``."""
        kind, api, index = text.split(":")
        if kind not in ("noise", "scale"):
            raise ValueError(f"fault {text!r}: the kind is noise or scale")
        return cls(kind, api, int(index))

    @property
    def record(self) -> str:
        """The forward record of the faulty call."""
        return f"{self.api}.{self.index}.forward"

    def owner(self) -> tuple[Any, str]:
        prefix, _, attr = self.api.partition(".")
        owners = {"Functional": torch.nn.functional, "Torch": torch, "Tensor": torch.Tensor}
        if prefix not in owners or not hasattr(owners[prefix], attr):
            raise ValueError(f"fault on {self.api!r}: not a Functional, Torch or Tensor API torch has")
        return owners[prefix], attr


def _debugger_globals() -> dict[str, Any]:
    """The module globals of the PrecisionDebugger in use: the one ``pytest_msprobe`` hands out (and keeps once
    asked), which is not the one in ``sys.modules`` after an in-process pytester run dropped the modules it
    imported first."""
    return pytest_msprobe.PrecisionDebugger.start.__globals__


def _precision_modules() -> list[Any]:
    """Every ``pytest_msprobe.dump.switches`` a run reads its switches and device through: the debugger's,
    its checklist's, and the one ``sys.modules`` holds now (the same module, but after in-process pytester
    runs)."""
    found: dict[int, Any] = {}
    debugger = _debugger_globals()
    checklist = debugger["StepChecklist"].start.__globals__
    for module in (debugger.get("switches"), checklist.get("switches"), sys.modules.get(_PRECISION)):
        if module is not None:
            found[id(module)] = module
    if not found:
        import pytest_msprobe.dump.switches as module

        found[id(module)] = module
    return list(found.values())


_PRECISION = "pytest_msprobe.dump.switches"


def _dump_index(api: str) -> int | None:
    """The index the dump gives the call of ``api`` being made (it counts before it calls), None when no
    dump is capturing on this thread."""
    started = _debugger_globals()["_STARTED"].get(threading.get_ident())
    recorder = getattr(started, "_recorder", None) if started is not None else None
    if recorder is None:
        return None
    count = recorder.counter.counts.get(api)
    return count - 1 if count else None


@dataclass
class Simulation:
    """A simulation in force: ``kernels`` (None without rounding), the fault's firings (step-less record
    names, in the order they fired)."""

    declare: bool
    kernels: TF32Kernels | None
    fault: Fault | None
    fired: list[str] = field(default_factory=list)


def _faulty(fault: Fault, orig: Callable[..., Any], fired: list[str]) -> Callable[..., Any]:
    def faulty(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        index = _dump_index(fault.api)
        if index != fault.index or not isinstance(out, torch.Tensor):
            return out
        if fault.kind == "scale":
            out.data.mul_(SCALE)
        else:  # a draw of its own: the training's generators draw as without the fault
            g = torch.Generator().manual_seed(1000 + len(fired))
            out.data.mul_(1 + NOISE * torch.randn(out.shape, generator=g, dtype=out.dtype))
        fired.append(fault.record)
        return out

    return faulty


def _declaring(real: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    def switches() -> dict[str, Any]:
        found = real()
        found["cudnn.allow_tf32"] = True
        found["cuda.matmul.allow_tf32"] = True
        return found

    return switches


@contextmanager
def simulated_tf32(
    declare: bool = True, inject: Fault | None = None, rounding: bool = True
) -> Iterator[Simulation]:
    """The simulated TF32 device while the block runs (see the module docstring); ``rounding=False`` leaves
    the kernels as they are (a fault on the CPU's own numbers)."""
    pristine.capture()  # torch's own functions, before the fault stands in one's place: what a replay runs
    patch = pytest.MonkeyPatch()
    kernels = TF32Kernels() if rounding else None
    sim = Simulation(declare, kernels, inject)
    try:
        for module in _precision_modules() if declare else ():
            patch.setattr(module, "switches", _declaring(module.switches))
            patch.setattr(module, "training_device", lambda model: "cuda")
        if inject is not None:
            owner, attr = inject.owner()
            patch.setattr(owner, attr, _faulty(inject, getattr(owner, attr), sim.fired))
        if kernels is not None:
            with kernels:
                yield sim
        else:
            yield sim
    finally:
        patch.undo()


@pytest.fixture
def simulated_device() -> Iterator[Callable[..., Simulation]]:
    """A factory: ``simulated_device(declare=True, inject=None)`` starts the simulated TF32 device for the rest
    of the test (ended at its teardown)::

        def test_tf32_side(simulated_device):
            sim = simulated_device(inject=Fault("noise", "Functional.relu", 1))
            train(...)
    """
    stack: list[Any] = []

    def start(declare: bool = True, inject: Fault | None = None, rounding: bool = True) -> Simulation:
        context = simulated_tf32(declare, inject, rounding)
        sim = context.__enter__()
        stack.append(context)
        return sim

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


# -- the plugin form (-p tests.devices) ----------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulated device", "another device's numerics on the CPU (tests/devices.py)")
    group.addoption(
        "--simulate-device",
        choices=("tf32", "tf32-undeclared"),
        default=None,
        help="compute float32 convolutions and matmuls in TF32 and declare a CUDA device with TF32 on "
        "(tf32-undeclared: the rounding without the declaration)",
    )
    group.addoption(
        "--simulate-fault",
        default=None,
        metavar="KIND:API:INDEX",
        help="an op fault in each dumped step: noise:Functional.relu:1 (1e-3 noise), scale:Functional.conv2d:0",
    )


@pytest.fixture(autouse=True)
def _simulated_device_of_the_run(request: pytest.FixtureRequest) -> Iterator[Simulation | None]:
    device = request.config.getoption("--simulate-device", None)
    spec = request.config.getoption("--simulate-fault", None)
    if device is None and spec is None:
        yield None
        return
    fault = Fault.parse(spec) if spec else None
    with simulated_tf32(declare=device == "tf32", inject=fault, rounding=device is not None) as sim:
        yield sim
