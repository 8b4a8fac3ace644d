"""The models, faults and training runs of ``bench/fault_suite.py``.

Two small models, random weights and synthetic data, trained three steps (0, 1, 2) under
``seed_all(1234, mode=True)``:

- ``cnn``: a ResNet-like CNN (conv2d without bias, batch_norm, relu, two residual blocks whose add is the
  in-place ``Tensor.add_``, max_pool2d, adaptive_avg_pool2d, linear), SGD with momentum;
- ``transformer``: a pre-LN block (``LAYERS``; embedding, layer_norm, q/k/v/o linear, matmul, in-place scale
  ``Tensor.mul_``, a causal ``masked_fill`` with -1e4, softmax, gelu MLP, residual adds), an in-place
  ``masked_fill_`` of the padded positions' embeddings, final layer_norm and head, cross_entropy, Adam.

A fault replaces one torch function for the run (reinstalled before every ``debugger.start()``, since a
debugger's ``stop()`` puts back what it found) with a version that keeps the op's own autograd node: the
original is called, then its output is changed in place through ``.data`` (no version bump: the node's saved
tensors stay usable), or a hook on the output's node (registered before the recorder's, so the recorder sees
the changed gradients) scales the gradients the node gives back. It fires on the ``index``-th call of its API
in a step (the dump's own call counter), or for the optimizer on the update of one parameter, and only in its
active steps; each firing is logged with the record name it makes, which is the ground truth.

Code run inside a backward hook runs while the recorder records: it calls the torch functions captured below,
at import, which no debugger wraps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_MUL = torch.mul
_RANDN = torch.randn
_WHERE = torch.where

STEPS = (0, 1, 2)
ACTIVATIONS: dict[str, tuple[int, ...]] = {"from0": (0, 1, 2), "at1": (1,), "at2": (2,)}
NOISE = 1e-3  # relative noise of a forward fault
GRAD_SCALE = 1.01  # a backward fault's gradient factor
MASK_FILL = -1e4
LEAK = 1e-3  # what a leaky masked softmax gives a masked position
LAYERS = 1  # two cost 3x the compare time (Adam's calls per parameter)


# --- models -----------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out.add_(x)  # the residual, in place (batch_norm's backward does not need its output)
        return F.relu(out)


class TinyCNN(nn.Module):
    """conv2d.0 / batch_norm.0 / relu.0 stem, max_pool2d, two blocks (conv2d.1-4, relu.1-4), pool, linear.0."""

    def __init__(self, c: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.block1 = _Block(c)
        self.block2 = _Block(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.stem(x))), 2)
        x = self.block2(self.block1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, order: Sequence[str]) -> torch.Tensor:
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        proj = {name: getattr(self, name)(x) for name in order}  # the projections in the model's order
        q, k, v = (proj[n].view(b, t, h, dh).transpose(1, 2) for n in ("q", "k", "v"))
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores.mul_(1.0 / math.sqrt(dh))  # in place: matmul's backward does not need its output
        scores = scores.masked_fill(causal, MASK_FILL)
        att = F.softmax(scores, dim=-1)
        ctx = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        return self.o(ctx)


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, order: Sequence[str]) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal, order)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Per step: embedding.0-1, masked_fill_.0, per layer layer_norm (2), linear q/k/v/o + fc1/fc2 (6),
    matmul (2), mul_ (1), masked_fill (1), softmax (1), gelu (1); then the final layer_norm and the head."""

    def __init__(
        self, vocab: int = 32, d: int = 32, heads: int = 2, layers: int = LAYERS, seq: int = 8
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(_Layer(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.order: Sequence[str] = ("q", "k", "v")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor, causal: torch.Tensor):
        x = self.tok(tokens) + self.pos(positions)
        x.masked_fill_(pad, 0.0)  # padded positions carry nothing
        for layer in self.layers:
            x = layer(x, causal, self.order)
        return self.head(self.ln(x))


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def build(name: str) -> Setup:
    """The model, its optimizer and data (call after seed_all: the same weights in every run)."""
    g = torch.Generator().manual_seed(7)
    if name == "cnn":
        cnn = TinyCNN()
        batches: list[tuple[torch.Tensor, ...]] = [
            (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in STEPS
        ]
        opt: torch.optim.Optimizer = torch.optim.SGD(cnn.parameters(), lr=0.05, momentum=0.9, foreach=False)
        return Setup(cnn, opt, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    if name == "transformer":
        tr = TinyTransformer()
        b, t, vocab = 4, 8, 32
        positions = torch.arange(t).expand(b, t)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        pad = torch.zeros(b, t, 1, dtype=torch.bool)
        pad[3, 5:] = True
        batches = []
        for _ in STEPS:
            tokens = torch.randint(0, vocab, (b, t), generator=g)
            targets = torch.randint(0, vocab, (b, t), generator=g).masked_fill(pad[..., 0], -100)
            batches.append((tokens, targets, positions, pad, causal))
        opt = torch.optim.Adam(tr.parameters(), lr=1e-3, foreach=False)

        def loss(m: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            tokens, targets, positions, pad, causal = batch
            logits = m(tokens, positions, pad, causal)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return Setup(tr, opt, batches, loss)
    raise ValueError(f"unknown model {name!r}")


# --- faults and benign variants ---------------------------------------------------------------------------

OWNERS: dict[str, Any] = {"F": torch.nn.functional, "torch": torch, "Tensor": torch.Tensor}
PREFIX = {"F": "Functional", "torch": "Torch", "Tensor": "Tensor"}


@dataclass(frozen=True)
class Fault:
    """One fault (or benign variant) of a model.

    ``effect``: ``noise`` (output x (1 + 1e-3 N(0,1))), ``grad_scale`` (the gradients the op's node gives back
    x 1.01), ``fill_value`` (masked_fill's value x 0.1: -1e3 for -1e4), ``fill_small`` (x 1.001: every filled
    element exactly 1e-3 off, the own error's bound), ``unmasked_noise`` (noise where the mask is False),
    ``masked_leak`` (softmax gives 1e-3 where its input was masked, instead of 0); benign: ``float64`` (the output computed in float64 and cast back), ``split_sum`` (the output summed over
    two halves of the reduced dimension), ``order`` (q/k/v projections in another order), ``rerun``.
    """

    name: str
    model: str
    kind: str  # forward, backward, optimizer, inplace, masked, benign
    effect: str
    owner: str = ""  # "F", "torch" or "Tensor"
    attr: str = ""
    index: int | None = None  # which call of the step fires (None: the optimizer's parameter ``param``)
    param: str = ""

    @property
    def benign(self) -> bool:
        return self.kind == "benign"

    @property
    def api(self) -> str:
        return f"{PREFIX[self.owner]}.{self.attr}"


def _f(name: str, model: str, kind: str, effect: str, owner: str, attr: str, index: int) -> Fault:
    return Fault(name, model, kind, effect, owner, attr, index)


FAULTS: list[Fault] = [
    # cnn
    _f("cnn.relu2.fwd", "cnn", "forward", "noise", "F", "relu", 2),
    _f("cnn.relu0.fwd", "cnn", "forward", "noise", "F", "relu", 0),
    _f("cnn.conv3.fwd", "cnn", "forward", "noise", "F", "conv2d", 3),
    _f("cnn.bn2.fwd", "cnn", "forward", "noise", "F", "batch_norm", 2),
    _f("cnn.linear0.fwd", "cnn", "forward", "noise", "F", "linear", 0),
    _f("cnn.add_6.inplace", "cnn", "inplace", "noise", "Tensor", "add_", 6),  # block2's residual
    Fault("cnn.sgd.optimizer", "cnn", "optimizer", "noise", "Tensor", "add_", None, "block2.conv1.weight"),
    _f("cnn.relu3.bwd", "cnn", "backward", "grad_scale", "F", "relu", 3),
    _f("cnn.conv2.bwd", "cnn", "backward", "grad_scale", "F", "conv2d", 2),
    _f("cnn.bn1.bwd", "cnn", "backward", "grad_scale", "F", "batch_norm", 1),
    # transformer (one layer: linear.0-2 q/k/v, .3 o, .4-5 fc1/fc2, .6 head; layer_norm.0-2 ln1/ln2/final)
    _f("tr.gelu0.fwd", "transformer", "forward", "noise", "F", "gelu", 0),
    _f("tr.softmax0.fwd", "transformer", "forward", "noise", "F", "softmax", 0),
    _f("tr.layer_norm1.fwd", "transformer", "forward", "noise", "F", "layer_norm", 1),
    _f("tr.linear2.fwd", "transformer", "forward", "noise", "F", "linear", 2),  # v
    _f("tr.matmul1.fwd", "transformer", "forward", "noise", "torch", "matmul", 1),  # att @ v
    _f("tr.embedding0.fwd", "transformer", "forward", "noise", "F", "embedding", 0),
    _f("tr.cross_entropy0.fwd", "transformer", "forward", "noise", "F", "cross_entropy", 0),
    _f("tr.mul_0.inplace", "transformer", "inplace", "noise", "Tensor", "mul_", 0),  # the scores' scale
    _f("tr.masked_fill_0.inplace", "transformer", "inplace", "unmasked_noise", "Tensor", "masked_fill_", 0),
    _f("tr.masked_fill0.value", "transformer", "masked", "fill_value", "Tensor", "masked_fill", 0),  # -1e3
    _f("tr.masked_fill0.value_small", "transformer", "masked", "fill_small", "Tensor", "masked_fill", 0),
    _f("tr.masked_fill0.unmasked", "transformer", "masked", "unmasked_noise", "Tensor", "masked_fill", 0),
    _f("tr.softmax0.leak", "transformer", "masked", "masked_leak", "F", "softmax", 0),
    Fault(
        "tr.adam.optimizer",
        "transformer",
        "optimizer",
        "noise",
        "Tensor",
        "addcdiv_",
        None,
        "layers.0.fc1.weight",
    ),
    _f("tr.gelu0.bwd", "transformer", "backward", "grad_scale", "F", "gelu", 0),
    _f("tr.softmax0.bwd", "transformer", "backward", "grad_scale", "F", "softmax", 0),
    _f("tr.layer_norm1.bwd", "transformer", "backward", "grad_scale", "F", "layer_norm", 1),
    _f("tr.linear4.bwd", "transformer", "backward", "grad_scale", "F", "linear", 4),  # fc1
    _f("tr.matmul1.bwd", "transformer", "backward", "grad_scale", "torch", "matmul", 1),
]

BENIGN: list[Fault] = [
    Fault("cnn.rerun", "cnn", "benign", "rerun"),
    Fault("cnn.conv2d.float64", "cnn", "benign", "float64", "F", "conv2d"),
    Fault("cnn.linear.float64", "cnn", "benign", "float64", "F", "linear"),
    Fault("cnn.conv2d.split_sum", "cnn", "benign", "split_sum", "F", "conv2d"),
    Fault("tr.rerun", "transformer", "benign", "rerun"),
    Fault("tr.linear.float64", "transformer", "benign", "float64", "F", "linear"),
    Fault("tr.matmul.float64", "transformer", "benign", "float64", "torch", "matmul"),
    Fault("tr.linear.split_sum", "transformer", "benign", "split_sum", "F", "linear"),
    Fault("tr.qkv.order", "transformer", "benign", "order"),
]


def _noise(shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return _RANDN(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _double(a: Any) -> Any:
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _split_sum(api: str, args: tuple[Any, ...], kwargs: dict[str, Any], orig: Callable[..., Any]) -> Any:
    """The op's output summed over two halves of its reduced dimension (another summation order)."""
    if api == "Functional.linear":
        x, w, *rest = args
        h = w.shape[1] // 2
        return orig(x[..., :h], w[:, :h], *rest, **kwargs) + orig(x[..., h:], w[:, h:])
    if api == "Functional.conv2d":
        x, w, b, *rest = args
        h = w.shape[1] // 2
        return orig(x[:, :h], w[:, :h], b, *rest, **kwargs) + orig(x[:, h:], w[:, h:], None, *rest, **kwargs)
    if api == "Torch.matmul":
        a, b = args
        h = a.shape[-1] // 2
        return orig(a[..., :h], b[..., :h, :]) + orig(a[..., h:], b[..., h:, :])
    raise ValueError(f"no split sum for {api}")


@dataclass
class Injector:
    """The fault of one run: installed before each step's ``debugger.start()``; ``fired``: (step, record)."""

    fault: Fault
    active: tuple[int, ...]
    model: nn.Module
    step: int = -1
    count: int = 0
    fired: list[tuple[int, str]] = field(default_factory=list)
    _orig: Any = None
    _own: bool = False
    _target: torch.Tensor | None = None
    reinstall: bool = True  # before each step (a pytest-msprobe debugger's stop() may remove it)

    def __post_init__(self) -> None:
        f = self.fault
        if f.effect == "order":
            self.model.order = ("v", "k", "q")  # type: ignore[assignment]
        if not f.owner:
            return
        owner = OWNERS[f.owner]
        self._own = f.attr in vars(owner)
        self._orig = getattr(owner, f.attr)
        if f.param:
            self._target = dict(self.model.named_parameters())[f.param]

    def begin_step(self, step: int) -> None:
        self.step, self.count = step, 0
        if self.fault.owner and self.reinstall:
            setattr(OWNERS[self.fault.owner], self.fault.attr, self._patched)

    def uninstall(self) -> None:
        f = self.fault
        if not f.owner:
            return
        owner = OWNERS[f.owner]
        if self._own:
            setattr(owner, f.attr, self._orig)
        elif f.attr in vars(owner):
            delattr(owner, f.attr)

    def _patched(self, *args: Any, **kwargs: Any) -> Any:
        f, orig = self.fault, self._orig
        index = self.count
        self.count += 1
        if f.benign:
            out = orig(*args, **kwargs)
            with torch.no_grad():
                if f.effect == "float64":
                    exact = orig(*map(_double, args), **{k: _double(v) for k, v in kwargs.items()})
                else:
                    exact = _split_sum(f.api, args, kwargs, orig)
                out.data.copy_(exact)
            return out
        if self.step not in self.active:
            return orig(*args, **kwargs)
        # the optimizer's fault: the update of one parameter (it runs under no_grad)
        fire = args[0] is self._target if f.param else index == f.index
        if not fire:
            return orig(*args, **kwargs)
        seed = 1000 * self.step + index
        if f.effect in ("fill_value", "fill_small"):
            tensor, mask, value, *rest = args
            out = orig(tensor, mask, value * (0.1 if f.effect == "fill_value" else 1.001), *rest, **kwargs)
        else:
            out = orig(*args, **kwargs)
        direction = "forward"
        if f.effect == "noise":
            out.data.mul_(1 + NOISE * _noise(out.shape, out.dtype, seed))
        elif f.effect == "unmasked_noise":
            mask = args[1]
            factor = 1 + NOISE * _noise(out.shape, out.dtype, seed)
            out.data.mul_(_WHERE(mask, torch.ones((), dtype=out.dtype), factor))
        elif f.effect == "masked_leak":
            out.data.masked_fill_(args[0] < MASK_FILL / 2, LEAK)
        elif f.effect == "grad_scale":
            direction = "backward"
            out.grad_fn.register_hook(
                lambda grad_inputs, _: tuple(None if g is None else _MUL(g, GRAD_SCALE) for g in grad_inputs)
            )
        self.fired.append((self.step, f"{f.api}.{index}.{direction}"))
        return out


def train(
    fault: Fault, active: tuple[int, ...], task: str, dump_path: Path, backend: str = "ours"
) -> list[tuple[int, str]]:
    """Train ``fault.model`` three steps, dumped at level L1 with ``task`` into ``dump_path`` by pytest-msprobe's
    PrecisionDebugger (``backend`` "ours") or msprobe's ("msprobe": one per process; it wraps the APIs once and
    keeps its wrappers, so the fault is installed once, before it); the faults fired, (step, record name)."""
    if backend == "msprobe":
        from msprobe.pytorch import PrecisionDebugger, seed_all
    else:
        from pytest_msprobe import PrecisionDebugger, seed_all

    seed_all(seed=1234, mode=True)
    setup = build(fault.model)
    injector = Injector(fault, active, setup.model)
    if backend == "msprobe":
        injector.begin_step(-1)
        injector.reinstall = False
    debugger = PrecisionDebugger(task=task, dump_path=str(dump_path), level="L1", step=list(STEPS))
    try:
        for step, batch in zip(STEPS, setup.batches):
            injector.begin_step(step)
            debugger.start()
            loss = setup.loss(setup.model, batch)
            setup.optimizer.zero_grad()
            loss.backward()
            setup.optimizer.step()
            debugger.stop()
            debugger.step()
    finally:
        if backend != "msprobe":
            debugger.close()
        injector.uninstall()
    return injector.fired


def main() -> None:
    """One dump in this process (msprobe's debugger is one per process): ``python fault_cases.py FAULT
    ACTIVE_STEPS TASK DUMP_PATH FIRED_JSON [BACKEND]``, ACTIVE_STEPS like ``0,1,2`` or ``-``."""
    import json
    import sys

    name, active, task, dump_path, fired_json, *rest = sys.argv[1:]
    torch.set_num_threads(1)
    fault = next(f for f in FAULTS + BENIGN if f.name == name)
    steps = tuple(int(s) for s in active.split(",")) if active != "-" else ()
    fired = train(fault, steps, task, Path(dump_path), *(rest or ["msprobe"]))
    Path(fired_json).write_text(json.dumps(fired))


if __name__ == "__main__":
    main()
