"""The checklist compare: what differs between two runs before any operator is suspected.

msprobe's guide starts every investigation here: most precision problems are not an operator's. Each dump pair's
``checklist.json`` files (see :mod:`pytest_msprobe.format.checklist`) are compared, and every difference is one
:class:`Difference` of a kind:

- failures, named for what they are, and the first divergence when they come no later than the first breaching
  call: ``structure`` (module tree, parameter and buffer names, shapes, dtypes), ``hyperparameter`` (an
  optimizer's class or a param group's scalar, at the first step it differs), ``parameter`` and ``buffer``
  (its values at the start of a step), ``data`` (the step's input batch);
- context, never a failure on its own: ``environment`` (a variable that changes numerics), ``version``,
  ``switch`` (torch's numeric switches, the seed, an optimizer's implementation flags); a difference expected
  between two device types (CUDA's versions and switches against an NPU's) is marked ``expected``.

How values are held: the batch exactly (it is read, not computed: the same data gives the same bytes on every
device); parameters and buffers exactly at step 0 (the initial weights: same seed, same init, same bytes), and at
a later step within their dtype's tolerance on each statistic (training on two devices moves them by rounding).
A parameter at the start of step N is checked only when step N - 1 was not compared: when it was, every change
made to the parameter during it was compared call by call (and an update from a gradient that is rounding noise
moves a weight far while no call is wrong). Buffers are checked at every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.thresholds import Thresholds
from pytest_msprobe.format.checklist import decode_number, read_checklist
from pytest_msprobe.format.files import read_json

STRUCTURE, HYPERPARAMETER, PARAMETER, BUFFER, DATA = (
    "structure",
    "hyperparameter",
    "parameter",
    "buffer",
    "data",
)
ENVIRONMENT, VERSION, SWITCH = "environment", "version", "switch"
FAILING_KINDS = (STRUCTURE, HYPERPARAMETER, PARAMETER, BUFFER, DATA)  # in the order they are named at a step
CONTEXT_KINDS = (ENVIRONMENT, VERSION, SWITCH)

# what is expected to differ between two device types (CUDA's against an NPU's, either against the CPU)
_DEVICE_ENV_PREFIXES = (
    "CUBLAS",
    "CUDA_",
    "NVIDIA_",
    "TORCH_ALLOW_TF32",
    "TORCH_CUDNN",
    "NCCL_",
    "HCCL_",
    "LCCL_",
    "ASCEND_",
    "CLOSE_MATMUL",
    "ATB_",
    "INF_NAN_MODE",
)
_DEVICE_VERSIONS = frozenset({"cuda", "cudnn", "torch_npu", "cann"})
_DEVICE_SWITCHES = ("cudnn.", "cuda.", "npu.")
_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})
_STATS = ("min", "max", "mean", "norm")


@dataclass(frozen=True)
class Difference:
    """One thing that differs between the two runs' checklists."""

    kind: str  # one of FAILING_KINDS or CONTEXT_KINDS
    name: str  # "c2.weight", "lr", "NVIDIA_TF32_OVERRIDE", "torch", "args.0"
    step: int | None
    rank: int | None
    target: str  # the target's value, as text ("unset" for an unset variable)
    baseline: str
    detail: str  # what differs, in a few words
    where: str = ""  # "before step 0", "param group 0", "the model's forward"
    expected: bool = False  # context that two device types are expected to differ in

    @property
    def failing(self) -> bool:
        return self.kind in FAILING_KINDS

    def headline(self, with_rank: bool = False) -> str:
        """``parameter c2.weight (before step 0): its values differ ...``; ``data (step 0, rank 1): ...``."""
        where = self.where
        if with_rank and self.rank is not None:
            where = f"{where}, rank {self.rank}" if where else f"rank {self.rank}"
        name = f" {self.name}" if self.name and self.kind != DATA else ""
        return f"{self.kind}{name}" + (f" ({where})" if where else "") + f": {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "step": self.step,
            "rank": self.rank,
            "where": self.where,
            "target": self.target,
            "baseline": self.baseline,
            "detail": self.detail,
            "failing": self.failing,
            "expected": self.expected,
        }


@dataclass(frozen=True)
class ChecklistResult:
    """Every checklist difference of a compare: failures in the order they happen, then context."""

    differences: tuple[Difference, ...]
    checked: int  # dump pairs whose two checklists were compared
    unchecked: tuple[str, ...] = ()  # why a dump pair's checklists were not (a side without one)

    @property
    def failures(self) -> list[Difference]:
        return [d for d in self.differences if d.failing]

    @property
    def context(self) -> list[Difference]:
        return [d for d in self.differences if not d.failing]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first(self) -> Difference | None:
        """The first failing difference: the model's structure, else the earliest step's hyperparameter,
        parameter, buffer or data difference (in that order within a step), lowest rank first."""
        failures = self.failures
        return failures[0] if failures else None

    def context_line(self, limit: int = 4) -> str | None:
        """``environment NVIDIA_TF32_OVERRIDE: unset vs 0; version torch: 2.4.0 vs 2.1.0 (expected)``."""
        shown = self.context
        if not shown:
            return None
        parts = [
            f"{d.kind} {d.name}: {d.target} vs {d.baseline}" + (" (expected)" if d.expected else "")
            for d in shown[:limit]
        ]
        more = f"; and {len(shown) - limit} more" if len(shown) > limit else ""
        return "; ".join(parts) + more

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked_dump_pairs": self.checked,
            "unchecked": list(self.unchecked),
            "passed": self.passed,
            "failures": [d.to_dict() for d in self.failures],
            "context": [d.to_dict() for d in self.context],
        }


def _order(d: Difference) -> tuple[int, int, int]:
    step = -1 if d.kind == STRUCTURE else (d.step if d.step is not None else -1)
    return (step, FAILING_KINDS.index(d.kind), d.rank or 0)


def _text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# ------------------------------------------------------------------------------------------------- context
def _context(t: Mapping[str, Any], b: Mapping[str, Any], rank: int | None) -> list[Difference]:
    devices_differ = t.get("device") != b.get("device")
    found: list[Difference] = []

    def differ(kind: str, name: str, tv: Any, bv: Any, expected: bool) -> None:
        found.append(
            Difference(
                kind,
                name,
                None,
                rank,
                _text(tv),
                _text(bv),
                f"{_text(tv)} vs {_text(bv)}",
                expected=expected and devices_differ,
            )
        )

    for section, kind in (("environment", ENVIRONMENT), ("versions", VERSION), ("switches", SWITCH)):
        tv_all, bv_all = t.get(section) or {}, b.get(section) or {}
        for name in dict.fromkeys((*tv_all, *bv_all)):
            tv, bv = tv_all.get(name), bv_all.get(name)
            if tv == bv:  # (unset on one side, absent from the other: the same)
                continue
            if section == "environment":
                expected = name.startswith(_DEVICE_ENV_PREFIXES)
            elif section == "versions":
                expected = name in _DEVICE_VERSIONS or (
                    name == "torch" and _base_version(tv) == _base_version(bv)
                )
            else:
                expected = name.startswith(_DEVICE_SWITCHES)
            differ(kind, name, tv, bv, expected)
    if t.get("seed") != b.get("seed"):
        differ(SWITCH, "seed", t.get("seed"), b.get("seed"), False)
    return found


def _base_version(text: Any) -> str:
    return str(text).split("+", 1)[0]


# ----------------------------------------------------------------------------------------------- failures
def _structure(t: Mapping[str, Any], b: Mapping[str, Any], rank: int | None) -> list[Difference]:
    ts, bs = t.get("structure"), b.get("structure")
    if not isinstance(ts, dict) or not isinstance(bs, dict):
        return []
    found: list[Difference] = []

    def add(name: str, tv: str, bv: str, detail: str) -> None:
        found.append(Difference(STRUCTURE, name, None, rank, tv, bv, detail, where="the model"))

    t_mods = {m[0]: m[1] for m in ts.get("modules", []) if isinstance(m, list) and len(m) == 2}
    b_mods = {m[0]: m[1] for m in bs.get("modules", []) if isinstance(m, list) and len(m) == 2}
    for name in dict.fromkeys((*b_mods, *t_mods)):
        tv, bv = t_mods.get(name), b_mods.get(name)
        if tv != bv:
            label = name or "(the model)"
            if tv is None or bv is None:
                side = "target" if bv is None else "baseline"
                add(name, _text(tv), _text(bv), f"module {label} ({tv or bv}) only in the {side}")
            else:
                add(name, tv, bv, f"module {label} is a {tv} in the target, a {bv} in the baseline")
    for section, what in (("parameters", "parameter"), ("buffers", "buffer")):
        tp, bp = ts.get(section) or {}, bs.get(section) or {}
        for name in dict.fromkeys((*bp, *tp)):
            tv, bv = tp.get(name), bp.get(name)
            if tv == bv:
                continue
            if tv is None or bv is None:
                side = "target" if bv is None else "baseline"
                add(name, _shape_text(tv), _shape_text(bv), f"{what} {name} only in the {side}")
            else:
                add(
                    name,
                    _shape_text(tv),
                    _shape_text(bv),
                    f"{what} {name} is {_shape_text(tv)} vs {_shape_text(bv)}",
                )
    return found


def _shape_text(entry: Any) -> str:
    if isinstance(entry, list) and len(entry) == 2:
        return f"{entry[0]} {entry[1]}"
    return _text(entry)


def _hyperparameters(
    t: Mapping[str, Any], b: Mapping[str, Any], step: int | None, rank: int | None
) -> tuple[list[Difference], list[Difference]]:
    """(failing differences, implementation flags that differ) of the optimizers' settings at a step."""
    t_opts, b_opts = t.get("optimizers") or [], b.get("optimizers") or []
    failing: list[Difference] = []
    flags: list[Difference] = []
    several = max(len(t_opts), len(b_opts)) > 1
    for i in range(max(len(t_opts), len(b_opts))):
        prefix = f"optimizer {i}, " if several else ""
        to = t_opts[i] if i < len(t_opts) else None
        bo = b_opts[i] if i < len(b_opts) else None
        if not isinstance(to, dict) or not isinstance(bo, dict):
            have = to if isinstance(to, dict) else bo
            side = "baseline" if isinstance(to, dict) else "target"
            cls = have.get("class") if isinstance(have, dict) else "?"
            # no settings to hold: what its missing calls mean is the coverage's to say
            flags.append(
                Difference(
                    SWITCH,
                    f"optimizer {i} (step {step})",
                    None,
                    rank,
                    _text(to and to.get("class")),
                    _text(bo and bo.get("class")),
                    f"the {side} makes no step of optimizer {i} ({cls}) in step {step}",
                )
            )
            continue
        if to.get("class") != bo.get("class"):
            failing.append(
                Difference(
                    HYPERPARAMETER,
                    "optimizer",
                    step,
                    rank,
                    _text(to.get("class")),
                    _text(bo.get("class")),
                    f"{to.get('class')} vs {bo.get('class')}",
                    where=prefix.rstrip(", ") or f"step {step}",
                )
            )
            continue
        t_groups, b_groups = to.get("groups") or [], bo.get("groups") or []
        if len(t_groups) != len(b_groups):
            failing.append(
                Difference(
                    HYPERPARAMETER,
                    "param_groups",
                    step,
                    rank,
                    str(len(t_groups)),
                    str(len(b_groups)),
                    f"{len(t_groups)} param groups vs {len(b_groups)}",
                    where=prefix.rstrip(", ") or f"step {step}",
                )
            )
            continue
        for g, (tg, bg) in enumerate(zip(t_groups, b_groups)):
            if not isinstance(tg, dict) or not isinstance(bg, dict):
                continue
            for key in dict.fromkeys((*bg, *tg)):
                tv, bv = tg.get(key), bg.get(key)
                if _same(tv, bv):
                    continue
                diff = Difference(
                    HYPERPARAMETER,
                    key,
                    step,
                    rank,
                    _text(tv),
                    _text(bv),
                    f"{_text(tv)} vs {_text(bv)}",
                    where=f"{prefix}param group {g}",
                )
                if key in _IMPLEMENTATION:
                    flags.append(
                        Difference(
                            SWITCH,
                            f"{key} ({prefix}param group {g})",
                            None,
                            rank,
                            diff.target,
                            diff.baseline,
                            diff.detail,
                        )
                    )
                else:
                    failing.append(diff)
    return failing, flags


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    x, y = decode_number(a), decode_number(b)
    return x is not None and y is not None and math.isnan(x) and math.isnan(y)


def _fingerprint_text(fp: Mapping[str, Any]) -> str:
    return f"{fp.get('shape')} {fp.get('dtype')}"


def _values_differ(
    tf: Mapping[str, Any], bf: Mapping[str, Any], exact: bool, thresholds: Thresholds
) -> str | None:
    """Why two fingerprints differ (None when they agree as this check holds them)."""
    if tf.get("shape") != bf.get("shape") or tf.get("dtype") != bf.get("dtype"):
        return f"it is {_fingerprint_text(tf)} vs {_fingerprint_text(bf)}"
    if tf.get("crc32") == bf.get("crc32") and tf.get("crc32") is not None:
        return None
    stats = _stat_text(tf, bf)
    if exact:
        return (
            f"its values differ (CRC32 {tf.get('crc32')} vs {bf.get('crc32')}{'; ' + stats if stats else ''})"
        )
    tol = thresholds.for_dtype(str(bf.get("dtype")))
    values = {k: (decode_number(tf.get(k)), decode_number(bf.get(k))) for k in _STATS}
    scale = max(
        (
            abs(v)
            for pair in (values["min"], values["max"])
            for v in pair
            if v is not None and math.isfinite(v)
        ),
        default=0.0,
    )
    worst: tuple[float, str] | None = None
    for name, (tv, bv) in values.items():
        if tv is None or bv is None:
            continue
        if not (math.isfinite(tv) and math.isfinite(bv)):
            if not _same(tv, bv):
                return f"its {name.capitalize()} is {tv:.6g} vs {bv:.6g} ({stats})"
            continue
        delta = abs(tv - bv)
        if delta <= tol.atol:
            continue
        ref = abs(bv) if name == "norm" else scale
        err = delta / ref if ref > 0 else math.inf
        if err > tol.error and (worst is None or err > worst[0]):
            worst = (err, name)
    if worst is None:
        return None
    return (
        f"its {worst[1].capitalize()} differs by {worst[0]:.3g} of its values' size (allowed {tol.error:g}; "
        f"{stats})"
    )


def _stat_text(tf: Mapping[str, Any], bf: Mapping[str, Any]) -> str:
    parts = []
    for name in _STATS:
        tv, bv = decode_number(tf.get(name)), decode_number(bf.get(name))
        if tv is not None and bv is not None and not _same(tv, bv):
            parts.append(f"{name.capitalize()} {tv:.6g} vs {bv:.6g}")
    return ", ".join(parts)


def _tensors(
    kind: str,
    section: str,
    t: Mapping[str, Any],
    b: Mapping[str, Any],
    step: int | None,
    rank: int | None,
    thresholds: Thresholds,
) -> list[Difference]:
    tp, bp = t.get(section), b.get(section)
    if not isinstance(tp, dict) or not isinstance(bp, dict):
        return []
    exact = step == 0
    found = []
    for name, bf in bp.items():
        tf = tp.get(name)
        if not isinstance(tf, dict) or not isinstance(bf, dict):
            continue  # a name one side lacks is the structure's difference
        why = _values_differ(tf, bf, exact, thresholds)
        if why is not None:
            found.append(
                Difference(
                    kind,
                    name,
                    step,
                    rank,
                    str(tf.get("crc32")),
                    str(bf.get("crc32")),
                    why,
                    where=f"before step {step}",
                )
            )
    return found


def _changed_outside(
    candidates: list[Difference],
    previous: tuple[Path, Path, dict[str, Any], dict[str, Any]],
    t_doc: Mapping[str, Any],
    b_doc: Mapping[str, Any],
) -> list[Difference]:
    """Of the weights that differ at the start of a step after a compared step, those that changed on the target
    outside the recorded calls: they moved during the previous step, and no recorded call of it gave out their
    new values (an optimizer's update gives out the updated weight), while the baseline's moved that way or not
    at all. A weight its optimizer updated from rounding noise moves far, but through a recorded call."""
    found = []
    t_prev_dump, b_prev_dump, t_prev, b_prev_doc = previous
    outputs: tuple[set[tuple[float, float]], set[tuple[float, float]]] | None = None
    for d in candidates:
        prev, now = (t_prev.get("parameters") or {}).get(d.name), (t_doc.get("parameters") or {}).get(d.name)
        if not isinstance(prev, dict) or not isinstance(now, dict) or prev.get("crc32") == now.get("crc32"):
            continue
        if outputs is None:  # read only when a weight needs it
            outputs = _recorded_outputs(t_prev_dump), _recorded_outputs(b_prev_dump)
        if _extremes(now) in outputs[0]:
            continue  # a recorded update left it so
        b_prev, b_now = (
            (b_prev_doc.get("parameters") or {}).get(d.name),
            (b_doc.get("parameters") or {}).get(d.name),
        )
        if not isinstance(b_prev, dict) or not isinstance(b_now, dict):
            continue
        if b_prev.get("crc32") != b_now.get("crc32") and _extremes(b_now) not in outputs[1]:
            continue  # the baseline's updates give out nothing to go by either (a fused optimizer)
        found.append(
            replace(
                d,
                detail=f"{d.detail}; it changed after step {(d.step or 1) - 1}'s recorded calls (none of them "
                "gives out these values): a change made outside the dumped calls",
            )
        )
    return found


def _extremes(fp: Mapping[str, Any]) -> tuple[float, float]:
    low, high = decode_number(fp.get("min")), decode_number(fp.get("max"))
    return (low if low is not None else math.nan, high if high is not None else math.nan)


def _recorded_outputs(dump_json: Path) -> set[tuple[float, float]]:
    """(Min, Max) of every tensor a dump's calls give out (forward outputs, in-place updates included)."""
    doc = read_json(dump_json if dump_json.suffix == ".json" else dump_json / "dump.json")
    found: set[tuple[float, float]] = set()
    data = doc.get("data") if isinstance(doc, dict) else None

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "Max" in value and "Min" in value:
                low, high = decode_number(value.get("Min")), decode_number(value.get("Max"))
                if low is not None and high is not None:
                    found.add((low, high))
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    if isinstance(data, dict):
        for record in data.values():
            if isinstance(record, dict):
                walk(record.get("output"))
    return found


def _data(
    t: Mapping[str, Any], b: Mapping[str, Any], step: int | None, rank: int | None
) -> tuple[list[Difference], str | None]:
    """(the batch's differences, why it could not be compared)."""
    td, bd = t.get("data"), b.get("data")
    if not isinstance(td, dict) or not isinstance(bd, dict):
        if isinstance(td, dict) != isinstance(bd, dict):
            side = "target" if not isinstance(td, dict) else "baseline"
            return [], f"the {side} recorded no input batch"
        return [], None
    if _source_kind(td.get("source")) != _source_kind(bd.get("source")):
        return [], f"the batches were taken at different places ({td.get('source')} vs {bd.get('source')})"
    tt, bt = td.get("tensors") or {}, bd.get("tensors") or {}
    found = []
    for name in dict.fromkeys((*bt, *tt)):
        tf, bf = tt.get(name), bt.get(name)
        if not isinstance(tf, dict) or not isinstance(bf, dict):
            side = "target" if isinstance(tf, dict) else "baseline"
            found.append(
                Difference(
                    DATA,
                    name,
                    step,
                    rank,
                    _text(tf and "given"),
                    _text(bf and "given"),
                    f"input {name} of {td.get('source')} is given only in the {side}",
                    where=f"step {step}",
                )
            )
            continue
        why = _values_differ(tf, bf, True, Thresholds())
        if why is not None:
            found.append(
                Difference(
                    DATA,
                    name,
                    step,
                    rank,
                    str(tf.get("crc32")),
                    str(bf.get("crc32")),
                    f"input {name} of {td.get('source')} ({_fingerprint_text(bf)}): {why}",
                    where=f"step {step}",
                )
            )
    return found, None


def _source_kind(source: Any) -> str:
    text = str(source)
    return "model" if text == "the model's forward" else "first call"


# ----------------------------------------------------------------------------------------------- the compare
def compare_checklists(
    pairs: Sequence[tuple[Path, Path, int | None, int | None]], thresholds: Thresholds
) -> ChecklistResult:
    """The checklist differences of the dump pairs ``(target dump.json, baseline dump.json, step, rank)``.

    A pair whose sides do not both have a checklist is not compared, and says why in ``unchecked`` (a plain
    msprobe dump has none); a checklist that is there but broken raises DumpFormatError naming it.
    """
    read: list[tuple[dict[str, Any], dict[str, Any], int | None, int | None]] = []
    dumps: dict[tuple[int | None, int | None], tuple[Path, Path, dict[str, Any], dict[str, Any]]] = {}
    unchecked: list[str] = []
    for t_path, b_path, step, rank in pairs:
        t_doc, b_doc = read_checklist(t_path), read_checklist(b_path)
        if t_doc is None or b_doc is None:
            side = "the baseline has" if b_doc is None else "the target has"
            if t_doc is None and b_doc is None:
                side = "neither dump has"
            unchecked.append(f"{_place(step, rank)}: {side} no checklist.json (a plain msprobe dump?)")
            continue
        read.append((t_doc, b_doc, step, rank))
        dumps[(step, rank)] = (t_path, b_path, t_doc, b_doc)
    compared_steps: dict[int | None, set[int | None]] = {}
    for _, _, step, rank in read:
        compared_steps.setdefault(rank, set()).add(step)
    failing: list[Difference] = []
    context: list[Difference] = []
    seen_context: set[tuple[str, str]] = set()
    structure_done: set[int | None] = set()
    seen_hyper: set[tuple[int | None, str, str]] = set()
    seen_values: set[tuple[str, int | None, str]] = set()
    for t_doc, b_doc, step, rank in read:
        for d in _context(t_doc, b_doc, rank):
            if (d.kind, d.name) not in seen_context:
                seen_context.add((d.kind, d.name))
                context.append(d)
        if rank not in structure_done:
            structure_done.add(rank)
            failing.extend(_structure(t_doc, b_doc, rank))
        hyper, flags = _hyperparameters(t_doc, b_doc, step, rank)
        for d in hyper:  # each setting at the first step it differs
            if (rank, d.where, d.name) not in seen_hyper:
                seen_hyper.add((rank, d.where, d.name))
                failing.append(d)
        for d in flags:
            if (d.kind, d.name) not in seen_context:
                seen_context.add((d.kind, d.name))
                context.append(d)
        previous_compared = step is not None and step - 1 in compared_steps.get(rank, set())
        # a weight after a compared step: its updates were compared call by call (and an update from rounding
        # noise moves it far while no call is wrong); buffers change through the calls they feed, checked always
        found: list[Difference] = []
        if previous_compared and step is not None:  # unless it changed outside the calls that were compared
            differ = _tensors(PARAMETER, "parameters", t_doc, b_doc, step, rank, thresholds)
            found.extend(_changed_outside(differ, dumps[(step - 1, rank)], t_doc, b_doc))
        else:
            found.extend(_tensors(PARAMETER, "parameters", t_doc, b_doc, step, rank, thresholds))
        if t_doc.get("taken") == b_doc.get("taken"):  # (a forward's buffer updates in one only otherwise)
            found.extend(_tensors(BUFFER, "buffers", t_doc, b_doc, step, rank, thresholds))
        for d in found:
            if (d.kind, rank, d.name) not in seen_values:
                seen_values.add((d.kind, rank, d.name))
                failing.append(d)
        data, why_not = _data(t_doc, b_doc, step, rank)
        failing.extend(data)
        if why_not:
            unchecked.append(f"{_place(step, rank)}: the input batch was not compared: {why_not}")
    failing.sort(key=_order)
    return ChecklistResult(tuple(failing) + tuple(context), len(read), tuple(unchecked))


def _place(step: int | None, rank: int | None) -> str:
    parts = [f"step {step}" if step is not None else "", f"rank {rank}" if rank is not None else ""]
    return ", ".join(p for p in parts if p) or "the dump"


def meaning(d: Difference) -> str:
    """What a failing difference means for the run, and where to look (the line under the first divergence)."""
    if d.kind == DATA:
        return (
            "the step's input batch is not the baseline's: the runs do not train on the same data (another data "
            "set or preprocessing, shuffling, random augmentation, or data made on the device with its own random "
            "generator: make it on the CPU and move it); every call after it reads other numbers"
        )
    if d.kind in (PARAMETER, BUFFER):
        what = "weights" if d.kind == PARAMETER else "buffers"
        if d.step == 0:
            return (
                f"the initial {what} are not the baseline's: the same seed and the model built on the CPU before "
                "it is moved (or the same checkpoint) give the same bytes on every device; every call that "
                "reads it differs from here on"
            )
        return (
            f"the {what} changed before this step in a way no compared call shows (steps that were not dumped, "
            "or a change made outside the dumped calls): dump the steps before it, or a trend of every step"
        )
    if d.kind == HYPERPARAMETER:
        return (
            "the optimizer is not set as the baseline's: the runs do not train the same way (an lr scheduler's "
            "value of this step included); set them alike before looking at any operator"
        )
    return (
        "the two runs do not train the same model (module tree, parameter or buffer names, shapes or dtypes): "
        "the calls cannot be held to each other until they do"
    )
