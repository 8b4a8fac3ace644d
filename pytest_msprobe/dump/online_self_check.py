"""The online self-check: each captured API call replayed on the CPU in float64 while the step runs, and the
call's own error recorded beside msprobe's files (``self_check.json``, :mod:`pytest_msprobe.format.own_errors`).

Before a captured call, its inputs are copied (in-place calls change them): floating tensors to the CPU in
float64, other tensors to the CPU, other values as they are. After it, the call is run again from that copy
with torch's own function (:mod:`pytest_msprobe.replay.pristine`, whatever stands in torch's namespaces now)
and each floating output is judged against it by the standard of :mod:`pytest_msprobe.replay.standard`. The
arguments and outputs go through the same two steps as a tensor dump replayed offline (the dump's JSON form of
them, :class:`~pytest_msprobe.dump.entries.Values`, then the replay's rebuild of that form): online and offline
give the same verdicts, and skip the same calls for the same reasons.

**The declared precision.** The replay emulates what the device declares (:mod:`pytest_msprobe.replay.emulate`):
the policy of its device as the step starts (:attr:`SelfCheck.policy`, set by the debugger: TF32 or HF32
convolutions and matmuls), and the autocast dtype read at each call, before it runs. A call with float32 inputs
under either is replayed with its kernels' operands rounded (cast) as the device's are; its record in the
sidecar says which format (``"emulated": "tf32"``), and the sidecar's header the policy.

**Backward.** When a backward record will follow (the call's output has an autograd node of its own), the
replay runs with gradients on and is kept until that record is written: the node of its output is then given
the incoming gradients (float64) and the gradients it gives back are judged against those the device gave
back (:func:`~pytest_msprobe.replay.backward.judge_backward`). Kept replays are let go after use, and at the
end of the step.

The replay leaves the training as it was: it never records (it runs inside the captured call, whose slot is
empty), and the CPU generator's state is put back after it (a replay that draws would change the training's
next draws). Nothing here raises into the training: a call that cannot be replayed, or whose replay raised, is
recorded as skipped with the reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch

from pytest_msprobe.dump import ops
from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.entries import Values
from pytest_msprobe.dump.stats import StatEngine, dtype_name
from pytest_msprobe.dump.switches import autocast_dtype
from pytest_msprobe.format.names import BACKWARD, FORWARD, MODULE_PREFIX, parse_name
from pytest_msprobe.format.numerics import Policy
from pytest_msprobe.format.own_errors import CallOwn
from pytest_msprobe.replay.apis import Target, draws, resolve
from pytest_msprobe.replay.arguments import (
    Unreplayable,
    as_leaf,
    flat,
    is_tensor_node,
    raised,
    rebuild_inputs,
)
from pytest_msprobe.replay.backward import judge_gradients, node_gradients, run_call
from pytest_msprobe.replay.emulate import Emulator, emulation_for, emulator
from pytest_msprobe.replay.offline import judge_forward

_CPU = torch.device("cpu")
_F64 = torch.float64
_C128 = torch.complex128
_NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)
_STRIDED = torch.strided
_detach = ops.detach
_to = ops.to
_get_rng_state = torch.get_rng_state
_set_rng_state = torch.set_rng_state
_TENSOR = "tensor"  # the key of a captured node that holds its tensor


class _Copies:
    """The tensors of a captured call's values, as nodes of the dump's JSON form that hold them: copies of its
    inputs (``widen``: float64 on the CPU), or its outputs and gradients as the device gave them (on the CPU;
    half types other than float16 in float32, which numpy reads)."""

    def __init__(self, widen: bool) -> None:
        self.widen = widen
        self.device = ""  # the device of the first tensor seen

    def item(self, t: torch.Tensor, data_name: str | None = None, remember: bool = False) -> dict[str, Any]:
        if t.layout is not _STRIDED or t.is_nested or t.is_meta:
            raise Unreplayable(f"a {'nested' if t.is_nested else 'meta' if t.is_meta else t.layout} tensor")
        if not self.device:
            self.device = t.device.type
        node: dict[str, Any] = {
            "type": "torch.Tensor",
            "dtype": dtype_name(t.dtype),
            "requires_grad": t.requires_grad,
        }
        t = _detach(t)
        if self.widen and t.is_floating_point():
            t = _to(t, _CPU, _F64, copy=True)
        elif self.widen and t.is_complex():
            t = _to(t, _CPU, _C128, copy=True)
        elif (
            t.is_floating_point()
        ):  # judged right away: no copy on the CPU, numpy reads float32/16 as they are
            t = _to(t, _CPU, t.dtype if t.dtype in _NUMPY_FLOATS else torch.float32)
        elif self.widen:
            t = _to(t, _CPU, copy=True)
        node[_TENSOR] = t
        return node


class _Capture(Values):
    """The dump's JSON form of a call's values (:class:`Values`), with tensors captured by :class:`_Copies`."""

    def __init__(self, config: DumpConfig, copies: _Copies) -> None:
        super().__init__(config, cast(StatEngine, copies))
        self.names = False
        self.copies = copies


def _held(node: dict[str, Any]) -> torch.Tensor:
    return cast(torch.Tensor, node[_TENSOR])


def _leaf(node: dict[str, Any]) -> torch.Tensor:
    return as_leaf(node, _held(node))


class SelfCheck:
    """The self-check of one step's API calls: every call's own error, by record name (:meth:`own_errors`).

    Everything runs on the thread of the call (or of the backward pass), as it returns: a judging thread beside
    the training was measured slower than none (the two fight over the GIL, numpy's judging giving it up and
    taking it back for every block); a large output's blocks are judged by worker threads meanwhile
    (:mod:`pytest_msprobe.replay.figures`).
    """

    def __init__(self, config: DumpConfig) -> None:
        # the device's declared precision as the step started (None: float32 everywhere)
        self.policy: Policy | None = None
        # the autocast dtype of the step's calls, where one ran under it
        self.autocast_seen: str | None = None
        self._calls: dict[str, CallOwn] = {}
        # backward record name -> its call's replay (float64, with its graph), or why there is none
        self._kept: dict[str, Any] = {}
        self._targets: dict[str, Target] = {}
        self._inputs = _Capture(config, _Copies(widen=True))
        self._outputs = _Capture(config, _Copies(widen=False))

    @property
    def device(self) -> str:
        return self._inputs.copies.device or self._outputs.copies.device

    @property
    def precision(self) -> Policy | None:
        """The policy the step's calls were judged by, with the autocast dtype they ran under."""
        policy = self.policy
        if policy is None or self.autocast_seen is None:
            return policy
        return replace(policy, autocast=self.autocast_seen)

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A copy of a call's inputs, taken before it runs (the JSON form, holding the copies), with the autocast
        dtype in force for it; or why not."""
        try:
            nodes = self._inputs.analyze_inputs("", args, kwargs, torch.is_grad_enabled())
        except Exception as exc:
            return _Skip(str(exc) if isinstance(exc, Unreplayable) else raised("copying its inputs", exc))
        policy = self.policy
        return _Copied(nodes, autocast_dtype(policy.device if policy is not None else self.device or "cpu"))

    def forward(self, api: str, fwd: str | None, bwd: str | None, inputs: Any, out: Any) -> None:
        """After a call: replay it from ``inputs`` and judge ``out`` (recorded as ``fwd`` when given); keep the
        replay for the backward record ``bwd`` when one will follow."""
        try:
            replay: Any = self._replay(api, bwd is not None, inputs)
            if fwd is not None:
                if isinstance(replay, _Skip):
                    self._calls[fwd] = CallOwn(skipped=replay.reason)
                else:
                    recorded = flat(self._outputs.analyze_output("", out, False))
                    expected = [_held(n) if is_tensor_node(n) else None for n in recorded]
                    outputs, why = judge_forward(replay.out, recorded, expected)
                    self._calls[fwd] = CallOwn(outputs, why, _label(replay.emulator))
        except Unreplayable as exc:
            replay = _Skip(str(exc))
            if fwd is not None:
                self._calls[fwd] = CallOwn(skipped=replay.reason)
        except Exception as exc:
            replay = _Skip(raised("the self-check", exc))
            if fwd is not None:
                self._calls[fwd] = CallOwn(skipped=replay.reason)
        if bwd is not None:
            self._kept[bwd] = replay

    def _replay(self, api: str, grad: bool, inputs: Any) -> _Replay | _Skip:
        """The call's replay from its copied inputs, or a _Skip saying why there is none."""
        if isinstance(inputs, _Skip):
            return inputs
        target = self._targets.get(api)
        if target is None:
            target = self._targets[api] = resolve(f"{api}.0.{FORWARD}")
        if target.fn is None:
            return _Skip(target.reason)
        copied = {"input_args": inputs.nodes[0], "input_kwargs": inputs.nodes[1]}
        if inputs.autocast is not None and self.autocast_seen is None:
            self.autocast_seen = inputs.autocast
        emulating = emulator(emulation_for(self.policy, inputs.autocast, copied))
        args, kwargs = rebuild_inputs(copied, _leaf if grad else _held)
        random = draws(target, args, kwargs)
        if random:
            return _Skip(random)
        state = _get_rng_state()
        try:
            replay, why = run_call(target, args, kwargs, grad, emulating)
        finally:
            _set_rng_state(state)
        return _Skip(why) if why else _Replay(replay, emulating)

    def backward(self, bwd: str, grads_in: list[Any], grads_out: list[Any]) -> None:
        """A backward record written: the kept replay's node given ``grads_in``, judged against ``grads_out``."""
        replay = self._kept.pop(bwd, None)
        if replay is None:
            return
        if isinstance(replay, _Skip):
            self._calls[bwd] = CallOwn(skipped=replay.reason)
            return
        try:
            nodes = self._inputs.analyze(grads_in, None, False)
            incoming = [_held(n) if is_tensor_node(n) else None for n in nodes]
            recorded = [self._outputs.analyze(g, None, True) for g in grads_out]
            dumped = [_held(n) if is_tensor_node(n) else None for n in recorded]
            given, why = node_gradients(replay.out, incoming, len(dumped), replay.emulator)
            if why:
                self._calls[bwd] = CallOwn(skipped=why)
            else:
                own = judge_gradients(incoming, recorded, dumped, given)
                self._calls[bwd] = CallOwn(own, emulated=_label(replay.emulator))
        except Unreplayable as exc:
            self._calls[bwd] = CallOwn(skipped=str(exc))
        except Exception as exc:
            self._calls[bwd] = CallOwn(skipped=raised("the self-check", exc))

    def finish(self) -> None:
        """The step's end: the replays kept for backward records that never came are let go."""
        self._kept.clear()

    def own_errors(self, data: dict[str, Any]) -> dict[str, CallOwn]:
        """Every API record of ``data`` (dump.json's entries) with its own error, in the dump's order; a record
        the self-check did not see (a collective) with the reason it is not replayed."""
        out: dict[str, CallOwn] = {}
        for name in data:
            if name.startswith(MODULE_PREFIX + ".") or parse_name(name).direction not in (FORWARD, BACKWARD):
                continue
            call = self._calls.get(name)
            out[name] = call if call is not None else CallOwn(skipped=resolve(name).reason or "not replayed")
        return out


class _Copied:
    """A call's inputs as copied before it ran (the JSON form), and the autocast dtype in force for it."""

    __slots__ = ("autocast", "nodes")

    def __init__(self, nodes: Any, autocast: str | None) -> None:
        self.nodes = nodes
        self.autocast = autocast


class _Replay:
    """A call's replayed outputs, and the emulation its backward runs under too."""

    __slots__ = ("emulator", "out")

    def __init__(self, out: Any, emulating: Emulator | None) -> None:
        self.out = out
        self.emulator = emulating


def _label(emulating: Emulator | None) -> str:
    return emulating.label if emulating is not None else ""


class _Skip:
    """Why a call has no replay."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason
