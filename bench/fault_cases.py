"""The models, faults and training runs of ``bench/fault_suite.py``.

Five small models, random weights and synthetic data, trained three steps (0, 1, 2) under
``seed_all(1234, mode=True)``, on the CPU, with single-tensor optimizers (``foreach=False``: plain msprobe
records no ``torch._foreach_*`` call):

- ``cnn``: a ResNet-like CNN (conv2d without bias, batch_norm, relu, two residual blocks whose add is the
  in-place ``Tensor.add_``, max_pool2d, adaptive_avg_pool2d, linear), SGD with momentum;
- ``transformer``: a pre-LN block (``LAYERS``; embedding, layer_norm, q/k/v/o linear, matmul, in-place scale
  ``Tensor.mul_``, a causal ``masked_fill`` with -1e4, softmax, gelu MLP, residual adds), an in-place
  ``masked_fill_`` of the padded positions' embeddings, final layer_norm and head, cross_entropy, Adam;
- ``lstm``: a language model, embedding (vocab 32, 16) -> ``nn.LSTM`` (one ``_VF.lstm`` call) -> a head
  linear whose weight is the embedding's (tied) -> cross_entropy on the next token, SGD with momentum;
- ``vit``: a tiny ViT, 4x4 patches of 3x16x16 images by a strided conv2d, flatten/transpose, a learned cls
  token put in front (``torch.cat``), a learned position embedding added, one pre-LN layer of the
  transformer's (its mask all False), layer_norm, a head on the cls token; the gradients clipped by
  ``clip_grad_norm_(max_norm=1.0, foreach=False)``, then AdamW;
- ``mlp``: Linear-GELU-Linear-GELU-Linear (width 32) under ``torch.autocast("cpu", dtype=torch.bfloat16)``,
  each step two micro-batches (loss / 2, a backward after each), one SGD step.

A fault replaces one torch function for the run (reinstalled before every ``debugger.start()``, since a
debugger's ``stop()`` puts back what it found) with a version that keeps the op's own autograd node: the
original is called, then its output is changed in place through ``.data`` (no version bump: the node's saved
tensors stay usable), or a hook on the output's node (registered before the recorder's, so the recorder sees
the changed gradients) scales the gradients the node gives back (``eps`` calls the original with another
eps; ``dtype`` returns ``out.to(another dtype)``, a node of its own). It fires on the ``index``-th call of its
API in a step (the dump's own call counter; calls the dumper makes itself are not counted), or for the
optimizer on the update of one parameter, and only in its active steps; each firing is logged with the record
name it makes, which is the ground truth.

A source fault changes something no recorded call produces: a parameter's or a buffer's values, the step's
input batch (in place, before the step's ``debugger.start()``), or a module's output in a forward hook (the
LSTM's: its ``_VF.lstm`` call is recorded by pytest-msprobe, not by msprobe 26, and either records its output
before the hook changes it). Active ``from0`` (or at any set of steps) means: the change is made afresh at the
start (or in the forward) of each active step, with noise seeded by the step, on top of whatever the
earlier steps left (a parameter perturbed at steps 0, 1 and 2 has three perturbations by step 2). It logs
``"{effect} {name}"``, no record name: its ground truth is the step's first record whose tensors differ from
the clean run's (at a later active step: from the run active only at the steps before), which the suite
takes from tensor dumps.

Code run inside a backward or module hook runs while the recorder records: it calls the torch functions
captured below, at import, which no debugger wraps.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ADD = torch.add
_MUL = torch.mul
_MUL_ = torch.Tensor.mul_
_RANDN = torch.randn
_WHERE = torch.where

STEPS = (0, 1, 2)
ACTIVATIONS: dict[str, tuple[int, ...]] = {"from0": (0, 1, 2), "at1": (1,), "at2": (2,)}
NOISE = 1e-3  # relative noise of a forward fault
GRAD_SCALE = 1.01  # a backward fault's gradient factor
MASK_FILL = -1e4
LEAK = 1e-3  # what a leaky masked softmax gives a masked position
LAYERS = 1  # two cost 3x the compare time (Adam's calls per parameter)
VOCAB = 32
LOW_NOISE = 4  # a 16-bit output's noise (and gradient factor - 1), in units of its dtype's epsilon
EPS = 1e-2  # the layer_norm eps of an ``eps`` fault
OTHER_DTYPE = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16, torch.float32: torch.float16}
MODELS = ("cnn", "transformer", "lstm", "vit", "mlp")


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


class TinyLSTM(nn.Module):
    """A language model: embedding.0, the nn.LSTM (one ``_VF.lstm`` call), the head linear.0 whose weight is the
    embedding's (tied: one parameter, ``emb.weight``)."""

    def __init__(self, vocab: int = VOCAB, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


class TinyViT(nn.Module):
    """Patch embedding conv2d.0 (4x4 patches of a 3x16x16 image), flatten/transpose, a learned cls token put in
    front (``torch.cat``), a learned position embedding added, one pre-LN layer of the transformer's (its mask
    all False: every patch sees every patch), the final layer_norm.2 and the head linear.6 on the cls token."""

    def __init__(
        self, d: int = 32, heads: int = 2, classes: int = 10, image: int = 16, patch: int = 4
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, d))
        self.layer = _Layer(d, heads)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        self.order: Sequence[str] = ("q", "k", "v")

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.layer(x, mask, self.order)
        return self.head(self.ln(x)[:, 0])


class TinyMLP(nn.Module):
    """linear.0, gelu.0, linear.1, gelu.1, linear.2 (per micro-batch: the second's calls follow, linear.3-5)."""

    def __init__(self, d: int = 16, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


@dataclass
class Setup:
    """``batches``: one per step; with ``micro`` > 1 a step's batch is a tuple of ``micro`` micro-batches, each
    one forward and backward (its loss / ``micro``), the gradients accumulated for one optimizer step. ``inputs``:
    which items of a (micro-)batch are the model's inputs (what a data fault changes)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[tuple[Any, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    micro: int = 1
    clip: float | None = None  # clip_grad_norm_(max_norm=clip, foreach=False) before the optimizer's step
    autocast: torch.dtype | None = None  # the forward and loss under torch.autocast("cpu", dtype=autocast)
    inputs: tuple[int, ...] = (0,)

    def micro_batches(self, step: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        batch = self.batches[step]
        return batch if self.micro > 1 else (batch,)

    def forward(self) -> Any:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast)


def build(name: str) -> Setup:
    """The model, its optimizer and data (call after seed_all: the same weights in every run)."""
    g = torch.Generator().manual_seed(7)
    if name == "cnn":
        cnn = TinyCNN()
        batches: list[tuple[Any, ...]] = [
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
    if name == "lstm":
        lm = TinyLSTM()
        batches = []
        for _ in STEPS:
            text = torch.randint(0, VOCAB, (4, 9), generator=g)
            batches.append((text[:, :-1].contiguous(), text[:, 1:].contiguous()))  # next-token targets
        opt = torch.optim.SGD(lm.parameters(), lr=0.1, momentum=0.9, foreach=False)

        def lm_loss(m: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            tokens, targets = batch
            logits = m(tokens)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return Setup(lm, opt, batches, lm_loss)
    if name == "vit":
        vit = TinyViT()
        mask = torch.zeros(17, 17, dtype=torch.bool)  # no position masked
        batches = [
            (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g), mask)
            for _ in STEPS
        ]
        opt = torch.optim.AdamW(vit.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        return Setup(vit, opt, batches, lambda m, b: F.cross_entropy(m(b[0], b[2]), b[1]), clip=1.0)
    if name == "mlp":
        mlp = TinyMLP()
        batches = [
            tuple(
                (torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)
            )
            for _ in STEPS
        ]
        opt = torch.optim.SGD(mlp.parameters(), lr=0.05, foreach=False)
        return Setup(
            mlp, opt, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro=2, autocast=torch.bfloat16
        )
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
    ``masked_leak`` (softmax gives 1e-3 where its input was masked, instead of 0), ``eps`` (layer_norm
    computed with eps 1e-2, the call's arguments as the model gave them), ``half`` (the output computed in
    float16 and cast back), ``dtype`` (the output returned in another dtype, ``out.to``: bfloat16 -> float16);
    a 16-bit output's noise, and a 16-bit gradient's factor - 1, is 4 epsilons of its dtype instead (1e-3 is
    below bfloat16's rounding).

    Source faults (``kind`` "source": no recorded call makes the change; ``param`` names what is changed):
    ``parameter`` (its values x (1 + 1e-3 N(0,1)) in place), ``buffer`` (+ 1e-3 N(0,1) (|value| + 1): a fresh
    running_mean is 0), ``data`` (the step's inputs: floats x (1 + 1e-3 N(0,1)), token ids two changed), each
    at the start of every active step, before ``debugger.start()``; ``unrecorded`` (the module ``param``'s
    output x (1 + 1e-3 N(0,1)) by a forward hook, in every active step's forward).

    Benign: ``float64`` (the output computed in float64 and cast back), ``split_sum`` (the output summed over
    two halves of the reduced dimension), ``order`` (q/k/v projections in another order), ``rerun``.
    """

    name: str
    model: str
    kind: str  # forward, backward, optimizer, inplace, masked, source, benign
    effect: str
    owner: str = ""  # "F", "torch" or "Tensor"
    attr: str = ""
    index: int | None = None  # which call of the step fires (None: the optimizer's parameter ``param``)
    # the optimizer fault's parameter; a source fault's parameter, buffer or module ("inputs": its data)
    param: str = ""

    @property
    def benign(self) -> bool:
        return self.kind == "benign"

    @property
    def source(self) -> bool:
        return self.kind == "source"

    @property
    def api(self) -> str:
        return f"{PREFIX[self.owner]}.{self.attr}"


def _f(name: str, model: str, kind: str, effect: str, owner: str, attr: str, index: int) -> Fault:
    return Fault(name, model, kind, effect, owner, attr, index)


def _s(name: str, model: str, effect: str, what: str = "inputs") -> Fault:
    return Fault(name, model, "source", effect, param=what)


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
    _f("tr.layer_norm1.eps", "transformer", "forward", "eps", "F", "layer_norm", 1),  # ln2
    _f("tr.softmax0.half", "transformer", "forward", "half", "F", "softmax", 0),
    # source faults of the cnn and the transformer
    _s("cnn.param.conv2", "cnn", "parameter", "block1.conv2.weight"),
    _s("cnn.buffer.bn1", "cnn", "buffer", "block1.bn1.running_mean"),
    _s("cnn.data", "cnn", "data"),
    _s("tr.param.k", "transformer", "parameter", "layers.0.attn.k.weight"),
    _s("tr.param.tok", "transformer", "parameter", "tok.weight"),
    _s("tr.data", "transformer", "data"),
    # lstm (embedding.0, the nn.LSTM, the tied head linear.0, cross_entropy.0)
    _f("lstm.linear0.fwd", "lstm", "forward", "noise", "F", "linear", 0),
    _f("lstm.embedding0.fwd", "lstm", "forward", "noise", "F", "embedding", 0),
    _f("lstm.linear0.bwd", "lstm", "backward", "grad_scale", "F", "linear", 0),
    Fault("lstm.sgd.optimizer", "lstm", "optimizer", "noise", "Tensor", "add_", None, "lstm.weight_hh_l0"),
    _s("lstm.unrecorded", "lstm", "unrecorded", "lstm"),
    _s("lstm.param.ih", "lstm", "parameter", "lstm.weight_ih_l0"),  # read by the LSTM's _VF.lstm only
    _s("lstm.param.tied", "lstm", "parameter", "emb.weight"),  # the embedding's and the head's
    _s("lstm.data", "lstm", "data"),
    # vit (conv2d.0 patches, cat.0 cls token, layer_norm.0-1 + linear.0-5 in the layer, layer_norm.2, linear.6)
    _f("vit.conv0.fwd", "vit", "forward", "noise", "F", "conv2d", 0),
    _f("vit.cat0.fwd", "vit", "forward", "noise", "torch", "cat", 0),
    _f("vit.layer_norm2.eps", "vit", "forward", "eps", "F", "layer_norm", 2),
    _f("vit.softmax0.half", "vit", "forward", "half", "F", "softmax", 0),
    _f("vit.gelu0.bwd", "vit", "backward", "grad_scale", "F", "gelu", 0),
    Fault("vit.adamw.optimizer", "vit", "optimizer", "noise", "Tensor", "addcdiv_", None, "cls"),
    _s("vit.param.pos", "vit", "parameter", "pos"),
    _s("vit.data", "vit", "data"),
    # mlp under bfloat16 autocast, two micro-batches a step (linear.0-2 and gelu.0-1 the first's)
    _f("mlp.gelu1.fwd", "mlp", "forward", "noise", "F", "gelu", 1),
    _f("mlp.linear1.dtype", "mlp", "forward", "dtype", "F", "linear", 1),  # float16 out of bfloat16
    _f("mlp.linear2.bwd", "mlp", "backward", "grad_scale", "F", "linear", 2),
    Fault("mlp.sgd.optimizer", "mlp", "optimizer", "noise", "Tensor", "add_", None, "fc2.weight"),
    _s("mlp.param.fc1", "mlp", "parameter", "fc1.weight"),
    _s("mlp.data", "mlp", "data"),
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
    Fault("lstm.rerun", "lstm", "benign", "rerun"),
    Fault("lstm.linear.float64", "lstm", "benign", "float64", "F", "linear"),
    Fault("lstm.linear.split_sum", "lstm", "benign", "split_sum", "F", "linear"),
    Fault("vit.rerun", "vit", "benign", "rerun"),
    Fault("vit.conv2d.float64", "vit", "benign", "float64", "F", "conv2d"),
    Fault("vit.linear.split_sum", "vit", "benign", "split_sum", "F", "linear"),
    Fault("mlp.rerun", "mlp", "benign", "rerun"),
    Fault("mlp.linear.float64", "mlp", "benign", "float64", "F", "linear"),
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


_TOOL = str(Path(__file__).resolve().parents[1] / "pytest_msprobe") + os.sep
_MSPROBE = f"{os.sep}msprobe{os.sep}"
# the files of the frames between a model's call and the function it calls, when a dumper's API wrapper records
# it (msprobe's parameter_adapter, in its pytorch/common/utils.py, wraps the Tensor methods)
_MSPROBE_WRAPPERS = (
    "pytorch/dump/api_dump/api_register.py",
    "pytorch/dump/api_dump/hook_module.py",
    "pytorch/common/utils.py",
    "core/dump/api_dump/api_registry.py",
)
_WRAPPERS = (
    *(os.path.join(_TOOL, "dump", f) for f in ("intercept.py", "api_calls.py")),
    *(os.path.join("msprobe", *f.split("/")) for f in _MSPROBE_WRAPPERS),
)


def _tool_call() -> bool:
    """Whether a patched function was called by a dumper itself, not by the training: the nearest caller
    outside the dumpers' API wrappers is pytest-msprobe's or msprobe's code (pytest-msprobe's checklist
    fingerprints call ``torch.cat``). Such a call is neither recorded nor counted by the dump, nor by the
    fault."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_WRAPPERS):
            frame = frame.f_back
            continue
        return name.startswith(_TOOL) or _MSPROBE in name
    return False


def _low(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _noise_factor(shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """1 + s N(0,1): s = NOISE, or for a 16-bit output LOW_NOISE x its epsilon (in float32; the caller rounds)."""
    if not _low(dtype):
        return _ADD(_MUL(_noise(shape, dtype, seed), NOISE), 1.0)
    return _ADD(_MUL(_noise(shape, torch.float32, seed), LOW_NOISE * torch.finfo(dtype).eps), 1.0)


def _scaled(g: torch.Tensor) -> torch.Tensor:
    factor = 1 + LOW_NOISE * torch.finfo(g.dtype).eps if _low(g.dtype) else GRAD_SCALE
    return _MUL(g, factor)


def _half(a: Any) -> Any:
    return a.half() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


@dataclass
class Injector:
    """The fault of one run: installed before each step's ``debugger.start()``; ``fired``: (step, record).

    A source fault changes its parameter, buffer or batch in :meth:`begin_step` (before the step's
    ``debugger.start()``, so a checklist taken at the start sees it), or perturbs its module's output in a
    forward hook; it logs ``"{effect} {name}"`` (``parameter lstm.weight_ih_l0``), not a record name."""

    fault: Fault
    active: tuple[int, ...]
    model: nn.Module
    setup: Setup | None = None  # the batches, for a data fault
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
        if f.effect == "unrecorded":
            self.model.get_submodule(f.param).register_forward_hook(self._unrecorded)
        if not f.owner:
            return
        owner = OWNERS[f.owner]
        self._own = f.attr in vars(owner)
        self._orig = getattr(owner, f.attr)
        if f.param:
            self._target = dict(self.model.named_parameters())[f.param]

    def begin_step(self, step: int) -> None:
        self.step, self.count = step, 0
        if self.fault.source and step in self.active and self.fault.effect != "unrecorded":
            self._change_source(step)
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

    def _change_source(self, step: int) -> None:
        """A parameter's values x (1 + 1e-3 N(0,1)), a buffer's + 1e-3 N(0,1) (|value| + 1), or the step's inputs
        (floats x (1 + 1e-3 N(0,1)), token ids: two changed), in place, outside any recorded call."""
        f, seed = self.fault, 1000 * step + 999
        with torch.no_grad():
            if f.effect == "parameter":
                t: torch.Tensor = dict(self.model.named_parameters())[f.param]
                t.mul_(1 + NOISE * _noise(t.shape, t.dtype, seed))
            elif f.effect == "buffer":  # (a fresh running_mean is 0: the change is absolute there)
                t = dict(self.model.named_buffers())[f.param]
                t.add_(NOISE * _noise(t.shape, t.dtype, seed) * (t.abs() + 1))
            elif f.effect == "data":
                assert self.setup is not None
                for i, micro in enumerate(self.setup.micro_batches(step)):
                    for item in self.setup.inputs:
                        _change_input(micro[item], seed + i)
        self.fired.append((step, f"{f.effect} {f.param}"))

    def _unrecorded(self, module: nn.Module, args: Any, output: Any) -> None:
        """The module's (first) output x (1 + 1e-3 N(0,1)) through ``.data``, by functions no debugger wraps."""
        if self.step not in self.active:
            return
        out = output[0] if isinstance(output, tuple) else output
        _MUL_(out.data, _noise_factor(out.shape, out.dtype, 1000 * self.step + 998))
        self.fired.append((self.step, f"unrecorded {self.fault.param}"))

    def _patched(self, *args: Any, **kwargs: Any) -> Any:
        f, orig = self.fault, self._orig
        if _tool_call():
            return orig(*args, **kwargs)
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
        elif f.effect == "eps":  # layer_norm(input, normalized_shape, weight, bias, eps)
            if len(args) >= 5:
                args = (*args[:4], EPS, *args[5:])
            else:
                kwargs = {**kwargs, "eps": EPS}
            out = orig(*args, **kwargs)
        else:
            out = orig(*args, **kwargs)
        direction = "forward"
        if f.effect == "noise":
            if _low(out.dtype):
                out.data.copy_(_MUL(out.data.float(), _noise_factor(out.shape, out.dtype, seed)))
            else:
                out.data.mul_(_noise_factor(out.shape, out.dtype, seed))
        elif f.effect == "unmasked_noise":
            mask = args[1]
            factor = 1 + NOISE * _noise(out.shape, out.dtype, seed)
            out.data.mul_(_WHERE(mask, torch.ones((), dtype=out.dtype), factor))
        elif f.effect == "masked_leak":
            out.data.masked_fill_(args[0] < MASK_FILL / 2, LEAK)
        elif f.effect == "half":
            with torch.no_grad():
                out.data.copy_(orig(*map(_half, args), **{k: _half(v) for k, v in kwargs.items()}))
        elif f.effect == "dtype":
            out = out.to(OTHER_DTYPE[out.dtype])  # a new node: autograd casts the gradient back
        elif f.effect == "grad_scale":
            direction = "backward"
            out.grad_fn.register_hook(
                lambda grad_inputs, _: tuple(None if g is None else _scaled(g) for g in grad_inputs)
            )
        self.fired.append((self.step, f"{f.api}.{index}.{direction}"))
        return out


def _change_input(t: torch.Tensor, seed: int) -> None:
    if t.is_floating_point():
        t.mul_(1 + NOISE * _noise(t.shape, t.dtype, seed))
        return
    g = torch.Generator().manual_seed(seed)
    for row in range(min(2, t.shape[0])):  # one token in each of the first two sequences
        col = int(torch.randint(0, t.shape[-1], (), generator=g))
        t[row, col] = (t[row, col] + int(torch.randint(1, VOCAB, (), generator=g))) % VOCAB


def train(
    fault: Fault, active: tuple[int, ...], task: str, dump_path: Path, backend: str = "ours"
) -> list[tuple[int, str]]:
    """Train ``fault.model`` three steps, dumped at level L1 with ``task`` into ``dump_path`` by pytest-msprobe's
    PrecisionDebugger (``backend`` "ours") or msprobe's ("msprobe": one per process; it wraps the APIs once and
    keeps its wrappers, so the fault is installed once, before it); the faults fired, (step, record name).

    A step: per micro-batch the forward and loss (under the model's autocast), ``zero_grad`` after the first
    forward, the backward; then the clipping, if any, and the optimizer's step."""
    if backend == "msprobe":
        from msprobe.pytorch import PrecisionDebugger, seed_all
    else:
        from pytest_msprobe import PrecisionDebugger, seed_all

    seed_all(seed=1234, mode=True)
    setup = build(fault.model)
    injector = Injector(fault, active, setup.model, setup)
    if backend == "msprobe":
        injector.begin_step(-1)
        injector.reinstall = False
    debugger = PrecisionDebugger(task=task, dump_path=str(dump_path), level="L1", step=list(STEPS))
    try:
        for step in STEPS:
            injector.begin_step(step)  # (a source fault changes the step's batch here)
            debugger.start()
            for i, micro in enumerate(setup.micro_batches(step)):
                with setup.forward():
                    loss = setup.loss(setup.model, micro)
                if setup.micro > 1:
                    loss = loss / setup.micro
                if i == 0:
                    setup.optimizer.zero_grad()
                loss.backward()
            if setup.clip is not None:
                torch.nn.utils.clip_grad_norm_(setup.model.parameters(), max_norm=setup.clip, foreach=False)
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
