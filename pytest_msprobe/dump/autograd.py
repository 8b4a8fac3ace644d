"""The capture and torch's autograd graph: backward records filled by hooks on its nodes, what is read from the
graph to place them, and the end of a backward pass.

A backward record (:class:`BackwardRecord`) is filled by hooks on autograd nodes (``node.register_hook``): an API
call's on the nodes of its outputs, a module call's on those and on its own nodes that take a gradient edge to one
of its inputs, found by walking the graph created during the call (:func:`find_consumers`). Parameter gradients
are recorded when the backward pass ends, from a final callback of the engine (:func:`queue_callback`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump.entries import iter_tensors
from pytest_msprobe.dump.step_records import StepRecords
from pytest_msprobe.dump.threads import claim_backward

_Tensor = torch.Tensor
_get_ident = threading.get_ident
_AccumulateGrad: Any = torch._C._functions.AccumulateGrad
get_sequence_nr: Callable[[], int] = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (raises outside of one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class BackwardRecord:
    """The backward record of one call, filled by hooks on autograd nodes, written by :meth:`emit` once the last
    of them has fired (at the end of the capture, for a record some of whose nodes never fire)."""

    __slots__ = ("name", "parent", "parts", "recorder", "want")

    def __init__(self, recorder: StepRecords, name: str, parent: str | None, n_nodes: int) -> None:
        self.recorder = recorder
        self.name = name
        self.parent = parent
        self.want = n_nodes  # node hooks still to fire
        # per node, what it gave: (grad_outputs, grad_inputs), where no ``take`` picks from them
        self.parts: list[tuple[tuple[Any, ...], tuple[Any, ...]] | None] = [None] * n_nodes

    def hook(self, index: int, take: Callable[[Any, Any], None] | None = None) -> Callable[[Any, Any], None]:
        """The hook of node ``index``: its gradients go to ``parts[index]``, or to ``take``, which picks some."""

        # one hook for every record: an API call's keeps all of a node's gradients without calling out (it runs
        # for every captured call), a module call's picks those of its outputs and inputs
        def on_node(grad_inputs: Any, grad_outputs: Any) -> None:
            recorder = self.recorder
            if recorder.closed:
                return
            if _get_ident() != recorder.owner:
                claim_backward(recorder)
            try:
                if take is None:
                    self.parts[index] = (tuple(grad_outputs), tuple(grad_inputs))
                else:
                    take(grad_inputs, grad_outputs)
                self.want -= 1
                if self.want == 0:
                    self.emit()
            except BaseException as exc:
                recorder.interrupted(exc)
                raise

        return on_node

    def emit(self) -> None:  # pragma: no cover - each kind of record writes itself
        raise NotImplementedError


def input_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
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


def find_consumers(
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
