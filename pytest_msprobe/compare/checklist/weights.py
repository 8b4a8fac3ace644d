"""The checklist's values: the weights, buffers and batch of two runs' checklists held to each other (see
:mod:`pytest_msprobe.compare.checklist.differences` for how)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.checklist.differences import DATA, Difference, same_value, value_text
from pytest_msprobe.format.checklistfile import TAKEN_AT_OPTIMIZER, decode_number
from pytest_msprobe.format.files import read_json
from pytest_msprobe.format.optimizerfile import read_optimizer
from pytest_msprobe.thresholds import Thresholds

_STATS = ("min", "max", "mean", "norm")


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
            if not same_value(tv, bv):
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
        if tv is not None and bv is not None and not same_value(tv, bv):
            parts.append(f"{name.capitalize()} {tv:.6g} vs {bv:.6g}")
    return ", ".join(parts)


def _by_crc(
    kind: str,
    name: str,
    step: int | None,
    rank: int | None,
    tf: Mapping[str, Any],
    bf: Mapping[str, Any],
    why: str,
    where: str,
    drift: bool = False,
) -> Difference:
    """A tensor's difference, its two values shown by their CRCs (a weight's, a buffer's or an input's)."""
    return Difference(
        kind, name, step, rank, str(tf.get("crc32")), str(bf.get("crc32")), why, where=where, drift=drift
    )


def tensor_differences(
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
    # exact at the start of training; buffers a step's forward already updated (taken at the optimizer's step)
    # went through recorded calls: held to their tolerance
    exact = step == 0 and not (section == "buffers" and t.get("taken") == TAKEN_AT_OPTIMIZER)
    found = []
    for name, bf in bp.items():
        tf = tp.get(name)
        if not isinstance(tf, dict) or not isinstance(bf, dict):
            continue  # a name one side lacks is the structure's difference
        why = _values_differ(tf, bf, exact, thresholds)
        if why is not None:
            found.append(_by_crc(kind, name, step, rank, tf, bf, why, f"before step {step}", drift=not exact))
    return found


def changed_outside(
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
                drift=False,
                detail=f"{d.detail}; it changed after step {(d.step or 1) - 1}'s recorded calls (none of them "
                "gives out these values): a change made outside the dumped calls",
            )
        )
    return found


def _extremes(fp: Mapping[str, Any]) -> tuple[float, float]:
    low, high = decode_number(fp.get("min")), decode_number(fp.get("max"))
    return (low if low is not None else math.nan, high if high is not None else math.nan)


def _recorded_outputs(dump_json: Path) -> set[tuple[float, float]]:
    """(Min, Max) of every tensor a dump's calls give out (forward outputs, in-place updates included), and of
    the weights its optimizer.json says each update left (a fused optimizer's, which dump.json does not hold)."""
    dump_json = dump_json if dump_json.suffix == ".json" else dump_json / "dump.json"
    doc = read_json(dump_json)
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
    for step in read_optimizer(dump_json) or ():
        for record in step.records.values():
            walk(record.get("output"))
    return found


def data_differences(
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
                    value_text(tf and "given"),
                    value_text(bf and "given"),
                    f"input {name} of {td.get('source')} is given only in the {side}",
                    where=f"step {step}",
                )
            )
            continue
        why = _values_differ(tf, bf, True, Thresholds())
        if why is not None:
            why = f"input {name} of {td.get('source')} ({_fingerprint_text(bf)}): {why}"
            found.append(_by_crc(DATA, name, step, rank, tf, bf, why, f"step {step}"))
    return found, None


def _source_kind(source: Any) -> str:
    text = str(source)
    return "model" if text == "the model's forward" else "first call"
