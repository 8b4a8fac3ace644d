"""What the capture reads from torch's autograd graph: the nodes a call's inputs had, the nodes of a module call
that consume its inputs, and the end of a backward pass.

A backward record is filled by hooks on autograd nodes (``node.register_hook``): an API call's on the nodes of its
outputs, a module call's on those and on its own nodes that take a gradient edge to one of its inputs, found by
walking the graph created during the call (:func:`find_consumers`). Parameter gradients are recorded when the
backward pass ends, from a final callback of the engine (:func:`queue_callback`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump.values import iter_tensors

_Tensor = torch.Tensor
_AccumulateGrad: Any = torch._C._functions.AccumulateGrad
get_sequence_nr: Callable[[], int] = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (raises outside of one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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
