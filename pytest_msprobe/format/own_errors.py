"""Each call's own error, recorded beside msprobe's files: ``self_check.json`` in the folder of its dump.json.

msprobe's own files stay as msprobe writes them; this sidecar holds, for every recorded API call of that
dump.json, how far its output (forward) or outgoing gradients (backward) were from the float64 replay of its
own inputs (one :class:`OwnError` per output tensor, ``null`` where nothing is judged: an integer output, a
None), or why the call was not replayed::

    {"format": "pytest-msprobe self-check", "version": 1, "device": "cuda", "source": "online",
     "precision": {"device": "cuda", "conv": "tf32", "matmul": "float32", "autocast": null, ...},
     "calls": {"Functional.conv2d.0.forward": {"outputs": [{"dtype": "float32", ...}], "emulated": "tf32"},
               "Functional.relu.2.forward": {"outputs": [{"dtype": "float32", "rel_share": 0.0, ...}]},
               "Functional.dropout.0.forward": {"skipped": "a random op: ..."}}}

``precision`` is the numerics policy the calls were judged by (:class:`~pytest_msprobe.format.numerics.Policy`,
``null`` where none was known), and a call's ``emulated`` the reduced format (or autocast dtype) its replay
computed its convolutions' and matrix products' operands in, as the device declares it does; a call without it
was replayed in float64 from its inputs as they are.

``pytest-msprobe replay`` writes the same per-call form into its ``replay.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import read_json, write_text

SELF_CHECK_JSON = "self_check.json"
SHARE_BOUNDS = (1e-2, 1e-3, 1e-4)
FORMAT = "pytest-msprobe self-check"
VERSION = 1


@dataclass(frozen=True)
class OwnError:
    """How far one output tensor of a call is from the float64 replay of the call's own inputs."""

    dtype: str
    elements: int
    max_abs: float
    max_rel: float
    mean_rel: float
    rmse: float
    rel_share: (
        float  # share of the elements whose relative error (floored denominator) passes its dtype's bound
    )
    small_breaches: int  # small elements off by more than msprobe's absolute bound (reported, not gating)
    ulp_mean: float | None  # float32 and half types: mean error in ULPs of the dumped dtype
    nonfinite_mismatch: int  # elements finite on one side only, or NaN on one side only
    out_of_line: bool  # by the dtype's standard alone, as judged where it was measured
    reason: str
    # the shares of the elements whose relative error passes 1e-2, 1e-3 and 1e-4 (msprobe's "double
    # hundredths, thousandths and ten-thousandths"): a call can be held to another dtype's bound later
    shares: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def share_over(self, bound: float) -> float:
        """The share of elements more than ``bound`` off (``bound`` one of SHARE_BOUNDS)."""
        return self.shares[SHARE_BOUNDS.index(bound)] if bound in SHARE_BOUNDS else self.rel_share

    def to_dict(self) -> dict[str, object]:
        doc = asdict(self)
        doc["shares"] = list(self.shares)
        return doc


_FIELDS = {f.name: f.type for f in fields(OwnError)}


@dataclass(frozen=True)
class CallOwn:
    """One recorded call: its own error per output tensor (None: not a floating tensor), or why it was not
    replayed (``skipped``)."""

    outputs: tuple[OwnError | None, ...] = ()
    skipped: str = ""
    emulated: str = ""  # the format its replay rounded its kernels' operands to ("tf32"), "" for none

    @property
    def out_of_line(self) -> bool:
        return any(o is not None and o.out_of_line for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        doc: dict[str, Any] = {"outputs": [o.to_dict() if o is not None else None for o in self.outputs]}
        if self.emulated:
            doc["emulated"] = self.emulated
        return doc


def own_errors_path(dump_json: str | Path) -> Path:
    """The sidecar of a dump.json: ``step0/rank/self_check.json`` beside ``step0/rank/dump.json``."""
    return Path(dump_json).with_name(SELF_CHECK_JSON)


def write_own_errors(
    dump_json: str | Path,
    calls: Mapping[str, CallOwn],
    device: str = "",
    source: str = "online",
    precision: Mapping[str, Any] | None = None,
) -> Path:
    """Write the sidecar of ``dump_json`` atomically (the old file, the whole new one, or none);
    ``precision``: the policy the calls were judged by (``Policy.to_dict()``)."""
    path = own_errors_path(dump_json)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "device": device,
        "source": source,
        "precision": dict(precision) if precision is not None else None,
        "calls": {name: call.to_dict() for name, call in calls.items()},
    }
    write_text(path, json.dumps(doc, indent=1, allow_nan=True))
    return path


def read_own_errors(dump_json: str | Path) -> dict[str, CallOwn] | None:
    """The sidecar of ``dump_json``: every call's own errors; None when there is none. A sidecar that is
    unusable raises DumpFormatError naming it and the problem."""
    path = own_errors_path(dump_json)
    if not path.exists():
        return None
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DumpFormatError(path, f'not a {FORMAT} file (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise DumpFormatError(path, f"version {doc.get('version')!r} is not the version {VERSION} this reads")
    calls = doc.get("calls")
    if not isinstance(calls, dict):
        raise DumpFormatError(path, "no 'calls' object")
    return {name: parse_call(path, name, entry) for name, entry in calls.items()}


def parse_call(path: Path, name: str, entry: Any) -> CallOwn:
    """One call's entry of a sidecar (or of replay.json)."""
    if not isinstance(entry, dict):
        raise DumpFormatError(path, f"calls.{name}: expected an object")
    if entry.get("skipped"):
        return CallOwn(skipped=str(entry["skipped"]))
    outputs = entry.get("outputs")
    if not isinstance(outputs, list):
        raise DumpFormatError(path, f"calls.{name}: no 'outputs' list")
    emulated = entry.get("emulated") or ""
    if not isinstance(emulated, str):
        raise DumpFormatError(path, f"calls.{name}.emulated: {emulated!r} is not a format name")
    own = tuple(_own_error(path, f"calls.{name}.outputs[{k}]", o) for k, o in enumerate(outputs))
    return CallOwn(own, emulated=emulated)


def _own_error(path: Path, where: str, doc: Any) -> OwnError | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(_FIELDS) - set(doc):
        missing = sorted(set(_FIELDS) - set(doc)) if isinstance(doc, dict) else []
        raise DumpFormatError(
            path, f"{where}: expected an own-error object" + (f", missing {missing}" if missing else "")
        )
    values: dict[str, Any] = {}
    for key in _FIELDS:
        value = doc[key]
        if key in ("dtype", "reason"):
            ok = isinstance(value, str)
        elif key == "out_of_line":
            ok = isinstance(value, bool)
        elif key == "shares":
            ok = (
                isinstance(value, list)
                and len(value) == len(SHARE_BOUNDS)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            )
            if ok:
                value = tuple(float(v) for v in value)
        elif key == "ulp_mean":
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        if not ok:
            raise DumpFormatError(path, f"{where}.{key}: {value!r} is not a valid value")
        values[key] = value
    return OwnError(**values)
