"""The checklist compare: each dump pair's two ``checklist.json`` files held to each other, every difference a
:class:`~pytest_msprobe.compare.checklist.differences.Difference` (see that module for the kinds and how values are held)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.checklist.differences import (
    BUFFER,
    ENVIRONMENT,
    HYPERPARAMETER,
    PARAMETER,
    STRUCTURE,
    SWITCH,
    VERSION,
    ChecklistResult,
    Difference,
    order_key,
    same_value,
    value_text,
)
from pytest_msprobe.compare.checklist.setting_causes import Calls, compare_settings
from pytest_msprobe.compare.checklist.weights import changed_outside, data_differences, tensor_differences
from pytest_msprobe.format.checklistfile import read_checklist
from pytest_msprobe.thresholds import Thresholds

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


# ------------------------------------------------------------------------------------------------- context
def context_differences(t: Mapping[str, Any], b: Mapping[str, Any], rank: int | None) -> list[Difference]:
    devices_differ = t.get("device") != b.get("device")
    found: list[Difference] = []

    def differ(kind: str, name: str, tv: Any, bv: Any, expected: bool) -> None:
        found.append(
            Difference(
                kind,
                name,
                None,
                rank,
                value_text(tv),
                value_text(bv),
                f"{value_text(tv)} vs {value_text(bv)}",
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
def structure_differences(t: Mapping[str, Any], b: Mapping[str, Any], rank: int | None) -> list[Difference]:
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
                add(name, value_text(tv), value_text(bv), f"module {label} ({tv or bv}) only in the {side}")
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
    return value_text(entry)


def hyperparameter_differences(
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
                    value_text(to and to.get("class")),
                    value_text(bo and bo.get("class")),
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
                    value_text(to.get("class")),
                    value_text(bo.get("class")),
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
                if same_value(tv, bv):
                    continue
                diff = Difference(
                    HYPERPARAMETER,
                    key,
                    step,
                    rank,
                    value_text(tv),
                    value_text(bv),
                    f"{value_text(tv)} vs {value_text(bv)}",
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


# ----------------------------------------------------------------------------------------------- the compare
def compare_checklists(
    pairs: Sequence[tuple[Path, Path, int | None, int | None]],
    thresholds: Thresholds,
    breached: Collection[tuple[int | None, int | None]] = (),
    calls: Calls | None = None,
) -> ChecklistResult:
    """The checklist differences of the dump pairs ``(target dump.json, baseline dump.json, step, rank)``.

    ``breached``: the (step, rank) pairs whose calls breach; a buffer that differs as the next step starts is
    what those calls did (a batch norm's running statistics), already reported through them, not a drift.
    ``calls``: the calls where a differing numerics setting finds the first call it changes (see
    :mod:`pytest_msprobe.compare.checklist.setting_causes`).
    A pair whose sides do not both have a checklist is not compared, and says why in ``unchecked`` (a plain
    msprobe dump has none); a checklist that is there but broken raises DumpFormatError naming it.
    """
    read: list[tuple[dict[str, Any], dict[str, Any], int | None, int | None]] = []
    dumps: dict[tuple[int | None, int | None], tuple[Path, Path, dict[str, Any], dict[str, Any]]] = {}
    unchecked: list[str] = []
    for t_path, b_path, step, rank in pairs:
        t_doc, b_doc = read_checklist(t_path), read_checklist(b_path)
        if t_doc is None or b_doc is None:
            side = "the baseline has no" if b_doc is None else "the target has no"
            if t_doc is None and b_doc is None:
                side = "neither dump has a"
            unchecked.append(f"{_place(step, rank)}: {side} checklist.json (a plain msprobe dump?)")
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
        for d in context_differences(t_doc, b_doc, rank):
            if (d.kind, d.name) not in seen_context:
                seen_context.add((d.kind, d.name))
                context.append(d)
        if rank not in structure_done:
            structure_done.add(rank)
            failing.extend(structure_differences(t_doc, b_doc, rank))
        hyper, flags = hyperparameter_differences(t_doc, b_doc, step, rank)
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
            differ = tensor_differences(PARAMETER, "parameters", t_doc, b_doc, step, rank, thresholds)
            found.extend(changed_outside(differ, dumps[(step - 1, rank)], t_doc, b_doc))
        else:
            found.extend(tensor_differences(PARAMETER, "parameters", t_doc, b_doc, step, rank, thresholds))
        # buffers a forward updates in one side's checklist only are not compared; nor those after a step whose
        # calls breach (they are what those calls did)
        after_breach = previous_compared and step is not None and (step - 1, rank) in breached
        if t_doc.get("taken") == b_doc.get("taken") and not after_breach:
            found.extend(tensor_differences(BUFFER, "buffers", t_doc, b_doc, step, rank, thresholds))
        for d in found:
            if (d.kind, rank, d.name) not in seen_values:
                seen_values.add((d.kind, rank, d.name))
                failing.append(d)
        data, why_not = data_differences(t_doc, b_doc, step, rank)
        failing.extend(data)
        if why_not:
            unchecked.append(f"{_place(step, rank)}: the input batch was not compared: {why_not}")
    settings = compare_settings(read, calls)
    failing.extend(settings.failing)
    # a flag whose setting was compared by what it does on each device is said once, by that setting
    context = [d for d in context if not (d.kind == SWITCH and d.name in settings.covered)]
    context.extend(settings.context)
    failing.sort(key=order_key)
    return ChecklistResult(tuple(failing) + tuple(context), len(read), tuple(unchecked), settings.policies)


def _place(step: int | None, rank: int | None) -> str:
    parts = [f"step {step}" if step is not None else "", f"rank {rank}" if rank is not None else ""]
    return ", ".join(p for p in parts if p) or "the dump"
