"""Relations between a call's statistics that hold whatever its inputs: a statistics dump's view of a call's own
error.

A statistics dump holds no tensors to replay, but for many APIs the output's Max, Min, Mean or Norm follow
exactly from the inputs' (up to the output dtype's rounding and the dumping side's arithmetic):

=================================================  ===============================================================
APIs                                               relation
=================================================  ===============================================================
view, reshape, flatten, transpose, permute,        Max, Min, Mean and Norm are the input's
contiguous, clone, squeeze, unsqueeze, detach ...
expand, repeat                                     Max, Min and Mean are the input's
relu, relu6, sigmoid, tanh, exp, sqrt              Max = f(input's Max), Min = f(input's Min) (f increasing)
gelu, silu                                         Max = f(input's Max), when that is positive
mul, div by a number c                             Max/Min (swapped for c < 0), Mean times c, Norm times abs(c)
add, sub of a number c                             Max, Min and Mean plus (minus) alpha times c
add, sub of two tensors                            Mean = Mean(a) plus (minus) alpha times Mean(b)
lerp with a number weight w                        Mean = Mean(a) + w (Mean(b) - Mean(a))
softmax                                            Mean = 1 / size of dim; Max <= 1, Min >= 0
max_pool*, avg_pool*, adaptive pools               the output within the input's range (and 0, for averages);
                                                   an adaptive average to one value per channel keeps the Mean
backward of view, reshape, transpose ... (above)   the gradient passed on has the incoming one's statistics
backward of relu, relu6, hardtanh, threshold       the gradient passed on within the incoming one's range (and
                                                   0), its Norm at most the incoming one's
=================================================  ===============================================================

(In-place variants too: a dump records a call's inputs before it runs.) A relation's **residual** is the
difference between the dumped statistic and the one the relation predicts, scaled like the compare's statistics
(by the largest magnitude involved; a Norm by the Norm). A call **breaks** a relation on the target when its
residual there exceeds both :func:`floor` (1e-5, or the output dtype's epsilon where larger: what rounding and a
float32 statistic leave) and 10 times the baseline's: a forward fault that adds 1e-3 noise to a relu's output
moves its Max 1e-3 off the input's, while the baseline's is exact. The first divergence uses it where errors
already flow into every call (see :mod:`pytest_msprobe.compare.diagnosis.divergence`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.dumps import OUTPUT, TENSOR, VALUE, Leaf

FLOOR = 1e-5  # a residual below this is rounding (a float32 Mean summed in float32 is good to ~1e-6)
BASELINE_FACTOR = 10.0  # the target's residual must be this many times the baseline's

_NAME = re.compile(r"^(?:Functional|Torch|Tensor|NPU|Aten|VF)\.(\w+?)\.\d+\.(forward|backward)$")
_EPS = {"float64": 2.2e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.8e-3}

_IDENTITY = {
    "view", "reshape", "flatten", "unflatten", "transpose", "permute", "contiguous", "clone", "t", "squeeze",
    "unsqueeze", "detach", "view_as", "reshape_as", "movedim", "swapaxes", "swapdims", "ravel",
}  # fmt: skip
_SPREAD = {"expand", "expand_as", "repeat"}
_GELU_C = math.sqrt(2.0 / math.pi)


def _relu6(x: float) -> float:
    return min(max(x, 0.0), 6.0)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


_MONOTONE: dict[str, Callable[[float], float]] = {
    "relu": lambda x: max(x, 0.0),
    "relu6": _relu6,
    "sigmoid": _sigmoid,
    "tanh": math.tanh,
    "exp": lambda x: math.exp(min(x, 700.0)),
    "sqrt": lambda x: math.sqrt(x) if x >= 0 else math.nan,
}
_SCALE_OPS = {
    "mul": 1,
    "__mul__": 1,
    "__rmul__": 1,
    "__imul__": 1,
    "div": -1,
    "__truediv__": -1,
    "__itruediv__": -1,
}
_SHIFT_OPS = {"add": 1, "__add__": 1, "__radd__": 1, "__iadd__": 1, "sub": -1, "__sub__": -1, "__isub__": -1}
_POOLS = re.compile(r"^(adaptive_)?(max|avg)_pool[123]d(_with_indices)?$")


@dataclass(frozen=True)
class Residual:
    """One relation of a call: its text, and what it predicts against what was dumped, on one side."""

    relation: str  # e.g. "Max = max(input's Max, 0)"
    dumped: float
    predicted: float
    scale: float

    @property
    def scaled(self) -> float:
        gap = self.dumped - self.predicted
        if "<=" in self.relation:
            gap = max(gap, 0.0)
        elif ">=" in self.relation:
            gap = max(-gap, 0.0)
        return abs(gap) / self.scale if self.scale > 0 else (0.0 if gap == 0 else math.inf)


def floor(dtype: str | None) -> float:
    """The residual rounding may leave in an output of ``dtype``."""
    return max(FLOOR, _EPS.get((dtype or "").replace("torch.", ""), 0.0))


def residuals(api: str, leaves: Sequence[Leaf]) -> list[Residual]:
    """The residuals of the relations call ``api`` keeps (see the module docstring), from its dumped leaves
    of one side; empty where none applies or a statistic it needs is missing."""
    m = _NAME.match(api)
    if m is None:
        return []
    op = m.group(1)
    if op.endswith("_") and not op.endswith("__"):
        op = op[:-1]
    args: dict[str, Leaf] = {}
    outs: list[Leaf] = []
    for leaf in leaves:
        if leaf.role == OUTPUT:
            outs.append(leaf)
        elif leaf.suffix.startswith(".input."):
            args[leaf.suffix[len(".input.") :]] = leaf
    if len(outs) != 1 or not _full(outs[0]):
        return []
    try:
        if m.group(2) == "backward":
            return _backward_relations(op, args, outs[0])
        return _relations(op, args, outs[0])
    except (ArithmeticError, ValueError, TypeError):  # (a hostile dump's numbers: no relation to check)
        return []


def _full(leaf: Leaf | None) -> bool:
    return (
        leaf is not None
        and leaf.kind == TENSOR
        and all(s is not None and math.isfinite(s) for s in leaf.stats)
    )


def _number(leaf: Leaf | None) -> float | None:
    if leaf is None or leaf.kind != VALUE or isinstance(leaf.value, bool):
        return None
    return float(leaf.value) if isinstance(leaf.value, (int, float)) else None


def _relations(op: str, args: dict[str, Leaf], out: Leaf) -> list[Residual]:
    a = args.get("0")
    if not _full(a):
        return []
    assert a is not None
    amax, amin, amean, anorm = (float(s) for s in a.stats)  # type: ignore[arg-type]
    omax, omin, omean, onorm = (float(s) for s in out.stats)  # type: ignore[arg-type]
    span = max(abs(amax), abs(amin), abs(omax), abs(omin))
    if op in _IDENTITY or op in _SPREAD:
        if a.dtype != out.dtype:
            return []
        found = [
            Residual("Max = input's Max", omax, amax, span),
            Residual("Min = input's Min", omin, amin, span),
            Residual("Mean = input's Mean", omean, amean, span),
        ]
        if op in _IDENTITY:
            found.append(Residual("Norm = input's Norm", onorm, anorm, max(onorm, anorm)))
        return found
    if op in _MONOTONE:
        f = _MONOTONE[op]
        if op == "sqrt" and amin < 0:
            return []
        return [
            Residual(f"Max = {op}(input's Max)", omax, f(amax), span),
            Residual(f"Min = {op}(input's Min)", omin, f(amin), span),
        ]
    if op in ("gelu", "silu"):
        if amax <= 0:
            return []
        if op == "silu":
            top = amax * _sigmoid(amax)
        elif args.get("approximate") is not None and args["approximate"].value == "tanh":
            top = 0.5 * amax * (1.0 + math.tanh(_GELU_C * (amax + 0.044715 * amax**3)))
        else:
            top = 0.5 * amax * (1.0 + math.erf(amax / math.sqrt(2.0)))
        return [Residual(f"Max = {op}(input's Max)", omax, top, span)]
    if op in _SCALE_OPS or op in _SHIFT_OPS:
        return _arithmetic(op, args, a, out, span)
    if op == "lerp":
        b, w = args.get("1"), _number(args.get("2") or args.get("weight"))
        if not _full(b) or w is None:
            return []
        assert b is not None and b.mean is not None and b.max is not None and b.min is not None
        scale = max(span, abs(b.max), abs(b.min))
        return [
            Residual(
                "Mean = input's Mean + weight x (end's Mean - input's Mean)",
                omean,
                amean + w * (b.mean - amean),
                scale,
            )
        ]
    if op == "softmax":
        dim = _number(args.get("1") or args.get("dim"))
        if dim is None or a.shape is None or not a.shape or int(dim) != dim:
            return []
        d = int(dim)
        if not -len(a.shape) <= d < len(a.shape) or a.shape[d] == 0:
            return []
        return [
            Residual(f"Mean = 1 / {a.shape[d]} (each row sums to 1)", omean, 1.0 / a.shape[d], 1.0),
            Residual("Max <= 1", omax, 1.0, 1.0),
            Residual("Min >= 0", omin, 0.0, 1.0),
        ]
    pool = _POOLS.match(op)
    if pool:
        average = pool.group(2) == "avg"
        top, bottom = (max(amax, 0.0), min(amin, 0.0)) if average else (amax, amin)
        found = [
            Residual("Max <= input's Max" + (" (or 0)" if average else ""), omax, top, span),
            Residual("Min >= input's Min" + (" (or 0)" if average else ""), omin, bottom, span),
        ]
        one_each = out.shape is not None and len(out.shape) > 2 and all(s == 1 for s in out.shape[2:])
        if pool.group(1) and average and one_each:
            found.append(Residual("Mean = input's Mean (one average per channel)", omean, amean, span))
        return found
    return []


def _backward_relations(op: str, args: dict[str, Leaf], out: Leaf) -> list[Residual]:
    """A backward record's: its input is the gradient flowing in, its output the gradient it passes on."""
    g = args.get("0")
    if not _full(g) or len(args) != 1:
        return []
    assert g is not None
    gmax, gmin, gmean, gnorm = (float(x) for x in g.stats)  # type: ignore[arg-type]
    omax, omin, omean, onorm = (float(x) for x in out.stats)  # type: ignore[arg-type]
    span = max(abs(gmax), abs(gmin), abs(omax), abs(omin))
    if op in _IDENTITY and g.dtype == out.dtype and g.shape is not None and out.shape is not None:
        if math.prod(g.shape) != math.prod(out.shape):
            return []
        return [
            Residual("Max = incoming gradient's Max", omax, gmax, span),
            Residual("Min = incoming gradient's Min", omin, gmin, span),
            Residual("Mean = incoming gradient's Mean", omean, gmean, span),
            Residual("Norm = incoming gradient's Norm", onorm, gnorm, max(onorm, gnorm)),
        ]
    if op in ("relu", "relu6", "threshold", "hardtanh") and g.shape == out.shape:
        # the gradient passed on is the one flowing in where the input passed, else 0
        return [
            Residual("Max <= incoming gradient's Max (or 0)", omax, max(gmax, 0.0), span),
            Residual("Min >= incoming gradient's Min (or 0)", omin, min(gmin, 0.0), span),
            Residual("Norm <= incoming gradient's Norm", onorm, gnorm, max(onorm, gnorm)),
        ]
    return []


def _arithmetic(op: str, args: dict[str, Leaf], a: Leaf, out: Leaf, span: float) -> list[Residual]:
    other = args.get("1") or args.get("other")
    alpha = _number(args.get("alpha"))
    alpha = 1.0 if alpha is None else alpha
    assert a.max is not None and a.min is not None and a.mean is not None and a.norm is not None
    assert out.max is not None and out.min is not None and out.mean is not None and out.norm is not None
    c = _number(other)
    if c is not None:
        if op in _SCALE_OPS:
            if _SCALE_OPS[op] < 0:
                if c == 0:
                    return []
                c = 1.0 / c
            hi, lo = (a.max * c, a.min * c) if c >= 0 else (a.min * c, a.max * c)
            scale = max(span, abs(hi), abs(lo))
            return [
                Residual(f"Max = input's {'Max' if c >= 0 else 'Min'} x {c:g}", out.max, hi, scale),
                Residual(f"Min = input's {'Min' if c >= 0 else 'Max'} x {c:g}", out.min, lo, scale),
                Residual(f"Mean = input's Mean x {c:g}", out.mean, a.mean * c, scale),
                Residual(
                    f"Norm = input's Norm x {abs(c):g}",
                    out.norm,
                    a.norm * abs(c),
                    max(out.norm, a.norm * abs(c)),
                ),
            ]
        shift = _SHIFT_OPS[op] * alpha * c
        scale = max(span, abs(shift))
        return [
            Residual(f"Max = input's Max + {shift:g}", out.max, a.max + shift, scale),
            Residual(f"Min = input's Min + {shift:g}", out.min, a.min + shift, scale),
            Residual(f"Mean = input's Mean + {shift:g}", out.mean, a.mean + shift, scale),
        ]
    if op in _SHIFT_OPS and _full(other):
        assert (
            other is not None and other.mean is not None and other.max is not None and other.min is not None
        )
        k = _SHIFT_OPS[op] * alpha
        scale = max(span, abs(k) * max(abs(other.max), abs(other.min)))
        sign = "+" if k >= 0 else "-"
        return [
            Residual(
                f"Mean = input's Mean {sign} {abs(k):g} x other's Mean",
                out.mean,
                a.mean + k * other.mean,
                scale,
            )
        ]
    return []


@dataclass(frozen=True)
class Broken:
    """A relation a call breaks on the target and keeps on the baseline."""

    target: Residual
    baseline: Residual

    @property
    def relation(self) -> str:
        return self.target.relation

    @property
    def reason(self) -> str:
        t, b = self.target, self.baseline
        stat = t.relation.split(" ", 1)[0]
        return (
            f"its statistics break a relation that holds whatever its inputs ({t.relation}): its {stat} is "
            f"{_g(t.dumped)} where its inputs give {_g(t.predicted)} ({_g(t.scaled)} of the values' size off; "
            f"{_g(b.scaled)} on the baseline)"
        )


def _g(x: float) -> str:
    return f"{x:.6g}"


def broken(api: str, target: Sequence[Leaf], baseline: Sequence[Leaf], dtype: str | None) -> Broken | None:
    """The relation call ``api`` breaks most on the target (see the module docstring), or None."""
    limit = floor(dtype)
    worst: Broken | None = None
    for t, b in zip(residuals(api, target), residuals(api, baseline)):
        if t.relation.split(" ", 1)[0] != b.relation.split(" ", 1)[0]:  # (another relation: no pair)
            continue
        off = t.scaled > limit and t.scaled > BASELINE_FACTOR * b.scaled
        if off and (worst is None or t.scaled > worst.target.scaled):
            worst = Broken(t, b)
    return worst
