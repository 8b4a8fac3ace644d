"""Dumps of a small transformer and a small CNN trained for a few steps, with benign and faulty variants.

``dump_model(path, ...)`` trains a seeded model (a 2-layer transformer with a causal mask written by
``masked_fill``, or a conv/BN CNN) and dumps every step with our ``PrecisionDebugger``, in msprobe's format.
Variants, active while the steps run:

- ``float64_matmul()``: every ``F.linear`` and ``torch.matmul`` computed in float64 and cast back to float32,
  forward and backward (more accurate, not less), each keeping the autograd node of the float32 call;
- ``perturb("linear", n, 1e-3)``: the output of the n-th call of the API in each step times (1 + 1e-3 N(0, 1));
- ``drift_under_mask(n, drift)``: the unmasked values of the n-th ``masked_fill`` of each step times (1 + drift);
  ``drift_under_added_mask(n, drift)`` the same for the n-th ``Tensor.__add__`` (with ``mask="add"``, the
  scores plus a 0 / fill mask);
- ``order="vkq"``: the attention's projections computed in another order (the same numbers).

A fault changes the output in place through ``.data``, so the op keeps its own autograd node (and its
backward record); calls made inside a recorded call are not recorded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from compare_helpers import seeded


def dump_model(
    path: Path,
    *,
    model: str = "transformer",
    task: str = "tensor",
    level: str = "L1",
    steps: int = 3,
    optimizer: str = "adam",
    seed: int = 1234,
    width: int = 32,
    layers: int = 2,
    fill: float = -1e4,
    mask: str = "fill",
    order: str = "qkv",
    variant: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Path:
    import torch
    import torch.nn.functional as F

    from pytest_msprobe import PrecisionDebugger

    with seeded(seed):
        net = _transformer(width, layers, fill, mask) if model == "transformer" else _cnn(width)
        for module in net.modules():
            if hasattr(module, "order"):
                module.order = order
        if optimizer == "adam":
            opt: Any = torch.optim.Adam(net.parameters(), lr=1e-3)
        else:
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator().manual_seed(0)
        with (
            (variant or contextlib.nullcontext)() as fault,
            PrecisionDebugger(dump_path=str(path), task=task, level=level, step=list(range(steps))) as dbg,
        ):
            for _ in range(steps):
                if model == "transformer":
                    tokens = torch.randint(0, 32, (4, 12), generator=data)
                    labels = torch.randint(0, 32, (4 * 12,), generator=data)
                else:
                    tokens = torch.randn(8, 3, 16, 16, generator=data)
                    labels = torch.randint(0, 10, (8,), generator=data)
                if fault is not None:
                    fault.reset()
                dbg.start(model=net)
                out = net(tokens)
                loss = F.cross_entropy(out.reshape(labels.numel(), -1), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                dbg.stop()
                dbg.step()
    return path


# -------------------------------------------------------------------------------------------------- models
def _transformer(width: int, layers: int, fill: float, masking: str) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads = 4

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
            self.o = nn.Linear(width, width)
            self.order = "qkv"

        def forward(self, x: Any, mask: Any) -> Any:
            b, n, d = x.shape
            split = {name: getattr(self, name)(x) for name in self.order}  # independent calls, any order
            q, k, v = (split[name].view(b, n, heads, d // heads).transpose(1, 2) for name in "qkv")
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // heads)
            if masking == "fill":
                scores = scores.masked_fill(mask, fill)
            else:  # an additive mask: the masked scores are the scores plus the fill
                scores = scores + torch.zeros(mask.shape).masked_fill(mask, fill)
            probs = F.softmax(scores, dim=-1)
            return self.o(torch.matmul(probs, v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = Attention()
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: Any, mask: Any) -> Any:
            x = x + self.attn(self.ln1(x), mask)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(width, 32)

        def forward(self, tokens: Any) -> Any:
            n = tokens.shape[1]
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x)

    return Transformer()


def _cnn(width: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Cnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
            self.b1 = nn.BatchNorm2d(width)
            self.c2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
            self.b2 = nn.BatchNorm2d(2 * width)
            self.fc = nn.Linear(2 * width, 10)

        def forward(self, x: Any) -> Any:
            x = F.relu(self.b1(self.c1(x)))
            x = F.relu(self.b2(self.c2(x)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    return Cnn()


# ------------------------------------------------------------------------------------------------- variants
class _Patch:
    """Replaces functions of torch while active; ``reset()`` starts a step's call counts afresh."""

    def __init__(self) -> None:
        self.calls = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.calls = 0

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        old = getattr(owner, name)
        self.saved.append((owner, name, old))
        setattr(owner, name, new)
        return old

    def restore(self) -> None:
        for owner, name, old in reversed(self.saved):
            setattr(owner, name, old)


@contextlib.contextmanager
def float64_matmul() -> Iterator[_Patch]:
    """Every F.linear and torch.matmul in float64, forward (the float32 result overwritten) and backward (the
    mm/addmm/bmm node's gradients recomputed in float64 by a hook), cast back to float32."""
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    patch = _Patch()

    def wide(x: Any) -> Any:
        return aten._to_copy(x, dtype=torch.float64)

    def exact(orig: Callable[..., Any], float64: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            with torch.no_grad():
                aten.copy_(out, aten._to_copy(float64(*args, **kwargs), dtype=out.dtype))
            node = _mm_node(out.grad_fn)
            if node is not None:
                node.register_hook(_float64_grads(node))
            return out

        return call

    def linear64(x: Any, w: Any, b: Any = None) -> Any:
        return aten.linear(wide(x), wide(w), None if b is None else wide(b))

    patch.replace(F, "linear", exact(F.linear, linear64))
    patch.replace(torch, "matmul", exact(torch.matmul, lambda a, b: aten.matmul(wide(a), wide(b))))
    try:
        yield patch
    finally:
        patch.restore()


def _mm_node(node: Any) -> Any:
    """The mm, addmm or bmm node under an output's grad_fn (through its views), or None."""
    for _ in range(8):
        if node is None or type(node).__name__.startswith(("AddmmBackward", "MmBackward", "BmmBackward")):
            return node
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if nxt else None
    return None


def _float64_grads(node: Any) -> Callable[[Any, Any], Any]:
    import torch

    aten = torch.ops.aten
    kind = type(node).__name__

    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        g = aten._to_copy(grad_outputs[0], dtype=torch.float64)
        if kind.startswith("Addmm"):
            a, b = node._saved_mat1, node._saved_mat2
        else:
            a, b = node._saved_self, node._saved_mat2
        a, b = aten._to_copy(a, dtype=torch.float64), aten._to_copy(b, dtype=torch.float64)
        if kind.startswith("Bmm"):
            grads = [aten.bmm(g, aten.transpose(b, 1, 2)), aten.bmm(aten.transpose(a, 1, 2), g)]
        else:
            grads = [aten.mm(g, aten.t(b)), aten.mm(aten.t(a), g)]
        if kind.startswith("Addmm"):
            grads = [None, *grads]  # (the bias's gradient is the incoming one: nothing to compute)
        return tuple(
            old if old is None or new is None else aten._to_copy(new, dtype=old.dtype)
            for old, new in zip(grad_inputs, grads)
        )

    return hook


@contextlib.contextmanager
def _on_call(owner: Any, name: str, call: int, edit: Callable[..., None]) -> Iterator[_Patch]:
    """``owner.name`` replaced so that ``edit(out, *args)`` changes the output of its ``call``-th call (0-based)
    of each step, in place (the op keeps its own autograd node)."""
    patch = _Patch()
    orig: Any = None

    def faulty(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        if patch.calls == call:
            edit(out, *args)
        patch.calls += 1
        return out

    orig = patch.replace(owner, name, faulty)
    try:
        yield patch
    finally:
        patch.restore()


def perturb(api: str, call: int, rel: float) -> contextlib.AbstractContextManager[_Patch]:
    """The output of the ``call``-th ``F.<api>`` call (0-based) of each step times (1 + rel * N(0, 1))."""
    import torch
    import torch.nn.functional as F

    def edit(out: Any, *_: Any) -> None:
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        out.data.mul_(1 + rel * noise)  # (.data: a relu's or softmax's backward reads its output)

    return _on_call(F, api, call, edit)


def drift_under_mask(call: int, drift: float) -> contextlib.AbstractContextManager[_Patch]:
    """The values the ``call``-th ``masked_fill`` of each step leaves unmasked, times (1 + drift)."""
    import torch

    def edit(out: Any, _self: Any, mask: Any, *_: Any) -> None:
        with torch.no_grad():
            out.copy_(torch.where(mask, out, out * (1 + drift)))

    return _on_call(torch.Tensor, "masked_fill", call, edit)


def drift_under_added_mask(call: int, drift: float) -> contextlib.AbstractContextManager[_Patch]:
    """The values the ``call``-th ``Tensor.__add__`` of each step leaves unmasked (where its other operand, the
    mask, is 0), times (1 + drift)."""
    import torch

    def edit(out: Any, _self: Any, other: Any) -> None:
        with torch.no_grad():
            out.copy_(torch.where(other == 0, out * (1 + drift), out))

    return _on_call(torch.Tensor, "__add__", call, edit)
