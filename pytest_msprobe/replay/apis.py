"""Which recorded API a name stands for, and whether it can be replayed.

``Functional.conv2d.0.forward`` is ``torch.nn.functional.conv2d``, ``Torch.matmul...`` ``torch.matmul``,
``Tensor.add_...`` the method ``torch.Tensor.add_`` (called with the tensor first), ``VF.lstm...``
``torch._VF.lstm``, ``Aten.add.Tensor...`` ``torch.ops.aten.add.Tensor``. A call that cannot be replayed
faithfully gets a reason instead: random ops (their output is a draw, not a function of the inputs), those
whose output is uninitialized memory (``empty_like``: whatever the allocator hands out), collectives (they need
the other ranks), NPU custom ops (they need torch_npu) and names torch does not have; and, once its arguments
are known (:func:`draws`), a call that draws with these arguments (attention with a dropout, a fractional
max-pool without its samples).

The callables of the four namespaces are torch's own, as :mod:`.pristine` captured them, whatever stands in
torch's namespaces now (a faulty function a test put there, the dump's wrappers); an ``Aten`` overload is
looked up in ``torch.ops.aten``, which nothing replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pytest_msprobe.format.names import parse_name
from pytest_msprobe.replay import pristine

# outputs that are draws: replaying them gives another draw, not the same value
RANDOM = frozenset(
    {
        "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
        "rrelu", "rrelu_", "gumbel_softmax", "rand", "rand_like", "randn", "randn_like", "randint",
        "randint_like", "randperm", "bernoulli", "bernoulli_", "multinomial", "normal", "normal_",
        "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "poisson",
        "native_dropout", "fused_dropout",
    }
)  # fmt: skip
# outputs that are uninitialized memory: what the allocator hands out, another each time
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
)
_NAMESPACES = frozenset({"Functional", "Torch", "Tensor", "VF"})  # captured by .pristine


def _aten(op: str) -> Any:
    """``add.Tensor`` -> ``torch.ops.aten.add.Tensor``; ``add`` -> its overload packet."""
    import torch

    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None and overload else packet


class Target(NamedTuple):
    """What a recorded name replays: the callable, or why there is none."""

    api: str  # "Functional.conv2d"
    fn: Callable[..., Any] | None
    reason: str  # why it cannot be replayed ("" when it can)

    @property
    def inplace(self) -> bool:
        op = self.api.rpartition(".")[2]
        return op.endswith("_") and not op.endswith("__")


def resolve(name: str) -> Target:
    """The API a record name stands for: ``resolve("Functional.relu.0.forward").fn is F.relu``."""
    api = parse_name(name).base
    prefix, _, op = api.partition(".")
    if prefix == "Distributed":
        return Target(api, None, "a collective: it needs the other ranks")
    if prefix == "NPU":
        return Target(api, None, "an NPU custom op: it needs torch_npu")
    if op.partition(".")[0] in RANDOM:  # (an Aten name carries its overload: native_dropout.default)
        return Target(api, None, "a random op: its output is a draw, not a function of its inputs")
    if op.partition(".")[0] in UNINITIALIZED:
        return Target(api, None, "its output is uninitialized memory, not a function of its inputs")
    if prefix == "Aten":
        fn = _aten(op) if op else None
    else:
        fn = pristine.lookup(prefix, op) if prefix in _NAMESPACES and op else None
    if fn is None or not callable(fn):
        return Target(api, None, f"{api} is not an API this torch has")
    other = pristine.replaced(prefix, op) if prefix in _NAMESPACES else ""
    if other:
        return Target(
            api, None, f"{api} stood replaced by {other} when torch's functions were taken: not torch's own"
        )
    return Target(api, fn, "")


# op -> (position, keyword) of its dropout probability, and of its training switch (None: it has none)
_DROPOUT_AT = {
    "scaled_dot_product_attention": ((4, "dropout_p"), None),
    "multi_head_attention_forward": ((10, "dropout_p"), (13, "training")),
}
# op -> (position, keyword) of the samples that fix its pooling regions (drawn when absent)
_SAMPLES_AT = {
    "fractional_max_pool2d": (5, "_random_samples"),
    "fractional_max_pool3d": (5, "_random_samples"),
    "fractional_max_pool2d_with_indices": (5, "_random_samples"),
    "fractional_max_pool3d_with_indices": (5, "_random_samples"),
}


def draws(target: Target, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why a call whose op draws only with some arguments draws with these (``""`` when it does not): an
    attention with a dropout probability above 0 (and training, where the op has the switch), a fractional
    max-pool without its ``_random_samples``. Its output is then a draw, as a random op's."""
    op = target.api.partition(".")[2]

    def arg(at: tuple[int, str], default: Any) -> Any:
        position, keyword = at
        if keyword in kwargs:
            return kwargs[keyword]
        return args[position] if position < len(args) else default

    if op in _DROPOUT_AT:
        p_at, training_at = _DROPOUT_AT[op]
        p = arg(p_at, 0.0)
        training = arg(training_at, True) if training_at is not None else True
        if isinstance(p, (int, float)) and p > 0 and training:
            return f"a random op with dropout_p={p}: its output is a draw, not a function of its inputs"
    elif op in _SAMPLES_AT and arg(_SAMPLES_AT[op], None) is None:
        return "a random op without _random_samples: its pooling regions are a draw"
    return ""
