"""Backward replay: a call's forward replayed in float64 with gradients on, its autograd node given the dumped
incoming gradients, and the gradients it gives back judged against the dumped outgoing ones.

Under an emulated precision (:mod:`.emulate`) the node is called inside the same emulation as the forward replay:
its backward kernels read the incoming gradient and the saved operands rounded, as the device's do.

The dump's ``backward.input`` is what flowed into the node of the call's output and ``backward.output`` what
that node gave back (its ``grad_inputs``, ``null`` where undefined), so the replay calls the same node of its
own float64 forward: the comparison holds whatever the node's inputs are (``linear`` gives the bias's gradient
first, as ``addmm`` does). Calls whose outputs have several nodes, or none of their own, are not replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch

from pytest_msprobe.errors import DumpFormatError, DumpReadError
from pytest_msprobe.format.numerics import Policy
from pytest_msprobe.replay.apis import Target, draws, resolve
from pytest_msprobe.replay.arguments import (
    Unreplayable,
    as_leaf,
    flat,
    is_tensor_node,
    load_tensor,
    out_of_memory,
    raised,
    rebuild_inputs,
)
from pytest_msprobe.replay.emulate import Emulator, autocast_of, emulation_for, emulator
from pytest_msprobe.replay.standard import OwnError, judge_output, sum_floor
from pytest_msprobe.replay.state import steady

OwnErrors = tuple[OwnError | None, ...]
R = TypeVar("R")
# the start of the reason when the replay's node is another than the dump's
_OTHER_NODE = "the replay's node gives"


def replay_backward(
    name: str,
    forward: dict[str, Any],
    backward: dict[str, Any],
    tensor_dir: Path,
    policy: Policy | None = None,
) -> tuple[OwnErrors, str, str]:
    """The own errors of one call's outgoing gradients, or ``((), reason)`` when it cannot be replayed, and
    the format its device's declared ``policy`` was emulated in (``""`` for none; see :mod:`.emulate`). Runs in
    the replay's own torch state (:mod:`.state`)."""
    with steady():
        return _replay_backward(name, forward, backward, tensor_dir, policy)


def _replay_backward(
    name: str,
    forward: dict[str, Any],
    backward: dict[str, Any],
    tensor_dir: Path,
    policy: Policy | None,
) -> tuple[OwnErrors, str, str]:
    target = resolve(name)
    if target.fn is None:
        return (), target.reason, ""

    def read() -> tuple[list[Any], dict[str, Any], list[Any], list[Any], list[Any]]:
        args, kwargs = rebuild_inputs(forward, lambda node: as_leaf(node, load_tensor(node, tensor_dir)))
        incoming = [
            load_tensor(n, tensor_dir) if is_tensor_node(n) else None for n in flat(backward.get("input"))
        ]
        recorded = flat(backward.get("output", []))
        dumped = [load_tensor(n, tensor_dir) if is_tensor_node(n) else None for n in recorded]
        return args, kwargs, incoming, recorded, dumped

    records, why = read_records(read)
    if records is None:
        return (), why, ""
    args, kwargs, incoming, recorded, dumped = records
    out, why, emulating = run_replayed(target, args, kwargs, forward, policy, grad=True)
    if why:
        return (), why, ""
    own, why = judge_backward(out, incoming, recorded, dumped, emulating)
    # which node a call's output gets can hang on its input's layout, which the tensor files do not keep: a 3-D
    # linear of a contiguous input is a view of addmm (one gradient), of a transposed one matmul and an in-place
    # add of the bias (two). The dump's count of gradients tells which; the same values, laid out the other
    # way, give the other node
    other = _strided(args[0]) if why.startswith(_OTHER_NODE) and args else None
    if other is not None:
        args[0] = other
        out, again = run_call(target, args, kwargs, True, emulating)
        if not again:
            retried, again = judge_backward(out, incoming, recorded, dumped, emulating)
            if not again:
                own, why = retried, ""
    return own, why, emulating.label if emulating is not None and not why else ""


def _strided(t: Any) -> torch.Tensor | None:
    """A leaf with ``t``'s values, not contiguous (its last two dimensions' strides swapped); None where ``t``
    is not a tensor of at least two dimensions of more than one element each, or is laid out so already."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or min(t.shape[-2:]) < 2 or not t.is_contiguous():
        return None
    with torch.no_grad():
        other = t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
    return other.requires_grad_(t.requires_grad)


def read_records(read: Callable[[], R]) -> tuple[R | None, str]:
    """What ``read`` rebuilds from a call's records (its inputs, the dumped tensors), or ``(None, reason)``
    where a record cannot be replayed or is malformed. A file that cannot be read raises: that is the
    machine's state, not the dump's, and skipping the call would change the verdict."""
    try:
        return read(), ""
    except DumpReadError:
        raise
    except (Unreplayable, DumpFormatError) as exc:
        return None, str(exc)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:  # a malformed record
        return None, raised("rebuilding its inputs", exc)


def run_replayed(
    target: Target,
    args: list[Any],
    kwargs: dict[str, Any],
    entry: dict[str, Any],
    policy: Policy | None,
    grad: bool,
) -> tuple[Any, str, Emulator | None]:
    """A call run on its rebuilt inputs under its device's declared precision, emulated (``entry`` is its
    forward record): ``(outputs, "", emulator)``, or a reason where it draws random numbers (no replay can
    draw the same) or raised."""
    random = draws(target, args, kwargs)
    if random:
        return None, random, None
    emulating = emulator(emulation_for(policy, autocast_of(entry), entry))
    out, why = run_call(target, args, kwargs, grad, emulating)
    return out, why, emulating


def run_call(
    target: Target, args: list[Any], kwargs: dict[str, Any], grad: bool, emulating: Emulator | None = None
) -> tuple[Any, str]:
    """Replay a call from its rebuilt arguments: ``(outputs, "")``, or ``(None, reason)`` when it raised.

    ``grad``: with gradients on, so that the backward replay can call the node of its output (an in-place
    call then changes a copy of its tensor: a leaf that needs a gradient cannot be changed in place).
    ``emulating``: the device's declared precision, emulated (:mod:`.emulate`).
    """
    assert target.fn is not None
    if grad and target.inplace and args and isinstance(args[0], torch.Tensor):
        args[0] = args[0].clone()
    try:
        with torch.enable_grad() if grad else torch.no_grad(), emulating or nullcontext():
            return target.fn(*args, **kwargs), ""
    except Exception as exc:  # a call its own recorded inputs do not rebuild: say so, do not guess
        if out_of_memory(exc):  # (the machine's state, not the call's: skipping would change the verdict)
            raise
        return None, raised("the replay", exc)


def judge_backward(
    out: Any,
    incoming: list[Any],
    recorded: list[Any],
    dumped: list[Any],
    emulating: Emulator | None = None,
) -> tuple[OwnErrors, str]:
    """The own errors of a call's outgoing gradients: the node of its replayed ``out`` (run with gradients on)
    given the ``incoming`` gradients (float64), against the ``dumped`` outgoing ones (``recorded``: their
    nodes, for the dtypes); ``((), reason)`` when they cannot be judged."""
    given, why = node_gradients(out, incoming, len(dumped), emulating)
    if why:
        return (), why
    return judge_gradients(incoming, recorded, dumped, given), ""


def node_gradients(
    out: Any, incoming: list[Any], expected: int, emulating: Emulator | None = None
) -> tuple[list[Any], str]:
    """The gradients the node of the replayed ``out`` gives back for the ``incoming`` ones (``expected`` of
    them, as the dump has), or ``([], reason)``; inside ``emulating`` where the forward ran in it."""
    outputs = [t for t in flat(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    nodes = {id(t.grad_fn): t.grad_fn for t in outputs}
    if len(nodes) != 1:
        return [], "its outputs have no autograd node of their own" if not nodes else "several output nodes"
    node: Any = next(iter(nodes.values()))  # a torch.autograd.graph.Node: calling it runs its backward
    if len(incoming) != len(outputs) or any(g is None for g in incoming):
        return [], f"{len(incoming)} incoming gradient(s) recorded for {len(outputs)} output(s)"
    try:
        with emulating or nullcontext():
            given = node(*incoming)
    except Exception as exc:
        if out_of_memory(exc):
            raise
        return [], raised("the replay's backward", exc)
    given = list(given) if isinstance(given, tuple) else [given]
    if len(given) != expected:
        return [], f"{_OTHER_NODE} {len(given)} gradient(s), the dump {expected}"
    return given, ""


def judge_gradients(
    incoming: list[Any], recorded: list[Any], dumped: list[Any], given: list[Any]
) -> OwnErrors:
    """The own errors of the ``dumped`` outgoing gradients against those the replay's node ``given``."""
    # a gradient with fewer elements than flow in is a sum over their positions (a bias, a weight)
    flowing = sum(g.numel() for g in incoming)
    scale = float(sum(torch.linalg.vector_norm(g, 1) for g in incoming)) / flowing if flowing else 0.0
    return tuple(
        judge_output(n, want, got, True, _floor(n, want, flowing, scale))
        for n, want, got in zip(recorded, dumped, given)
    )


def _floor(node: Any, want: Any, flowing: int, scale: float) -> float:
    if not isinstance(want, torch.Tensor) or not want.numel() or not isinstance(node, dict):
        return 0.0
    return sum_floor(str(node.get("dtype")).removeprefix("torch."), flowing / want.numel(), scale)
