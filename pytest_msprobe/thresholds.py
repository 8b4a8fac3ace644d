"""Thresholds as data: a dtype table and per-API overrides (set by :mod:`pytest_msprobe.options`).

The compare judges every row by its **scaled error**, a difference measured against the size of the tensor it
belongs to (see :mod:`pytest_msprobe.compare.judging.metrics`): in statistics mode the largest difference of Max, Min,
Mean (divided by the tensor's range) and Norm (divided by the larger norm); in tensor mode RelL2Err (EucDist /
norm: the error of the tensor as a whole; of the values outside a mask fill that sets the tensor's scale, see
:mod:`pytest_msprobe.compare.judging.metrics`). A row is an **error** above the ``error`` tolerance of its dtype, a
**warning** above ``warning``; absolute differences at or below ``atol`` never count (they are below what the
dtype can hold for values that small). ScaledMaxAbsErr (MaxAbsErr / largest magnitude) above the error
tolerance while RelL2Err is within it is a warning: a few elements off is what an element-wise division by a
value near zero makes of rounding on any two devices (Adam's update of a weight whose gradient is rounding
noise differs by up to the learning rate, 1e-3 of the weight's range and more), not a precision regression.

Default tolerances (the baseline's dtype applies: the target must reproduce the baseline to the baseline's
precision, so a bfloat16 target against a float32 baseline is held to float32; a dtype difference is also
reported as a warning):

============== ======== ========== ======== ===========================================================
dtype          error    warning    atol     why
============== ======== ========== ======== ===========================================================
float64        1e-7     1e-9       1e-30    ~1e8 ulps of float64: only real computation changes
float32        1e-4     1e-5       1e-9     100x the ~1e-6 of cross-device float32 noise (other kernels,
                                            other summation order); a 1e-3 perturbation of one op's
                                            output (RelL2Err ~6e-4) is 6x over it. atol: msprobe's
                                            small-value bound for float32 (its standard judges values under
                                            1e-6 by an absolute error of 1e-9): the rounding of float32 sums
                                            of terms near 1e-2 (eps 1.2e-7), where a gradient that is zero
                                            in exact arithmetic lies (an attention key's bias under softmax)
float16        5e-3     1e-3       1e-7     ~10 half-ulps of float16 (eps 9.8e-4)
bfloat16       2e-2     8e-3       1e-12    ~5 half-ulps of bfloat16 (eps 7.8e-3)
float8 (all)   0.25     0.125      1e-5     ~2 half-ulps of float8_e4m3 (eps 0.125)
complex        as the float of the same width
int, uint,     0        0          0        exact values (statistics mode: as float32, since the
bool                                        dumping side computes Mean and Norm in floating point)
============== ======== ========== ======== ===========================================================

In tensor mode msprobe 8.3.3's accuracy rule also applies (``msprobe_rule``, on by default): a row fails
when ``(Cosine < 0.99 and MaxAbsErr > 0.001) or Cosine < 0.9 or MaxAbsErr > 1``. Its result is the
"Accuracy Reached or Not" column; on its own it is too loose to see a 1e-3 perturbation (cosine 1.0).

md5 mode compares the CRC32s: a row whose CRC differs is an error when its statistics differ too, and a
warning when they are identical (msprobe computes CRCs in a background thread, so in-place ops such as
batch_norm's running statistics or an in-place ReLU can change a tensor under it).

Overrides: ``rtol``/``warn_rtol``/``atol`` replace the error/warning/atol of every floating dtype (the
warning level follows at a tenth of the error tolerance unless given); ``dtype_rtol`` sets one dtype;
API rules (glob patterns on the API or row name, last match wins) set the error tolerance of matching rows
or skip them (reported, never failing). ``amplification`` (10) is how much larger an API's output error
must be than its input error for the first divergence to be placed there when errors already flow in.

``max_unmatched`` (5%) bounds how much of the baseline may go uncompared: in each dump pair (step, rank), the
share of the baseline's rows that found no partner in the target. Above it the compare fails, whatever the
rows that were compared say: a run that skipped its backward, dumped another level or trained another model
pairs few rows, and the few it pairs may well pass.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.format.files import config_error, read_json


@dataclass(frozen=True)
class Tolerance:
    """When a scaled error is an error or a warning; absolute differences <= ``atol`` never count."""

    error: float
    warning: float
    atol: float = 0.0

    def looser(self, other: Tolerance) -> Tolerance:
        return Tolerance(
            max(self.error, other.error), max(self.warning, other.warning), max(self.atol, other.atol)
        )


def warning_of(error: float) -> float:
    """The warning threshold that goes with an error threshold given alone: a tenth of it (as msprobe's standard
    has it). The one place that says so: a dtype, an API rule and the command line's --msprobe-rtol all use it."""
    return error / 10


_F64 = Tolerance(1e-7, 1e-9, 1e-30)
_F32 = Tolerance(1e-4, 1e-5, 1e-9)
_EXACT = Tolerance(0.0, 0.0, 0.0)

DEFAULT_DTYPE_TOLERANCES: Mapping[str, Tolerance] = {
    "float64": _F64,
    "complex128": _F64,
    "float32": _F32,
    "complex64": _F32,
    "float16": Tolerance(5e-3, 1e-3, 1e-7),
    "bfloat16": Tolerance(2e-2, 8e-3, 1e-12),
    "float8_e4m3fn": Tolerance(0.25, 0.125, 1e-5),
    "float8_e5m2": Tolerance(0.25, 0.125, 1e-5),
    "float8_e4m3fnuz": Tolerance(0.25, 0.125, 1e-5),
    "float8_e5m2fnuz": Tolerance(0.25, 0.125, 1e-5),
    **{
        name: _EXACT
        for name in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool")
    },
}

# the share of the baseline's rows a dump pair may leave without a partner in the target: room for a few calls
# that differ between library versions (26.x's API list against 8.3.3's: 2-3% of a small ResNet's rows), not
# for a missing backward or optimizer step (more than half of a training step's rows)
DEFAULT_MAX_UNMATCHED = 0.05


@dataclass(frozen=True)
class OwnRatios:
    """How many times the baseline's own error a call's own error may be (msprobe's benchmark comparison):
    the count of small values off by more than the absolute bound, the RMSE, the mean and the largest
    relative error."""

    small: float
    rmse: float
    mean_rel: float
    max_rel: float


# msprobe's guard levels: L2 for the APIs whose precision training is most sensitive to, L1 for a few with
# indexed writes, L0 for every other
OWN_LEVELS: Mapping[str, OwnRatios] = {
    "L0": OwnRatios(2.0, 2.0, 2.0, 10.0),
    "L1": OwnRatios(2.0, 1.5, 1.5, 5.0),
    "L2": OwnRatios(2.0, 1.2, 1.2, 2.0),
}
OWN_LEVEL_OF: Mapping[str, str] = {
    **{op: "L2" for op in (
        "addmm", "matmul", "mm", "bmm", "linear", "layer_norm", "gelu", "sum", "index", "one_hot",
        "nonzero", "cross_entropy", "rms_norm", "npu_rms_norm",
    )},
    **{op: "L1" for op in ("embedding", "scatter_", "scatter_add_", "npu_fusion_attention")},
}  # fmt: skip
# the share of a call's elements that may be more than the measuring bound off (1e-3 relative for float32
# and float64, 1e-2 for half types: msprobe's "double thousandths" and "double hundredths")
DEFAULT_OWN_SHARE: Mapping[str, float] = {"float64": 1e-3, "float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}

FLOATING = frozenset(name for name, tol in DEFAULT_DTYPE_TOLERANCES.items() if tol.error > 0)

_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "long": "int64",
    "int": "int32",
}


@functools.lru_cache(maxsize=256)
def normalize_dtype(dtype: str | None) -> str | None:
    """``torch.float32`` / ``fp32`` / ``float32`` -> ``float32``; None for no dtype."""
    if dtype is None:
        return None
    name = dtype.strip().lower()
    for prefix in ("torch.", "numpy.", "np."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return _ALIASES.get(name, name)


def is_integral(dtype: str | None) -> bool:
    name = normalize_dtype(dtype)
    return name is not None and (name.startswith(("int", "uint")) or name == "bool")


@dataclass(frozen=True)
class ApiRule:
    """An override for rows whose API name or row name matches ``pattern`` (a glob)."""

    pattern: str
    error: float | None = None
    warning: float | None = None
    atol: float | None = None
    skip: bool = False
    own_share: float | None = None  # the self-check's share bound for matching calls (see OwnStandard)
    own_level: str | None = None  # their guard level: L0, L1 or L2 (the ratios to the baseline's own error)

    def matches(self, api: str, row: str) -> bool:
        return fnmatchcase(api, self.pattern) or fnmatchcase(row, self.pattern)


@dataclass(frozen=True)
class Thresholds:
    """Everything the verdict depends on. Build with defaults, from options, or from a JSON file."""

    dtypes: Mapping[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_DTYPE_TOLERANCES))
    apis: tuple[ApiRule, ...] = ()
    amplification: float = 10.0
    msprobe_rule: bool = True
    max_unmatched: float = DEFAULT_MAX_UNMATCHED  # share of a dump pair's baseline rows left unpaired

    def for_dtype(self, dtype: str | None) -> Tolerance:
        name = normalize_dtype(dtype)
        if name is None:
            return self.dtypes.get("float32", _F32)
        return self.dtypes.get(name) or self.dtypes.get("float32", _F32)

    def tolerance(
        self, dtype: str | None, api: str, row: str, statistics: bool = False
    ) -> tuple[Tolerance, bool]:
        """The tolerance of a row whose baseline has ``dtype`` (then API rules), and whether it is skipped.

        The baseline's dtype decides: the target must reproduce the baseline to the baseline's precision
        (a bfloat16 target against a float32 baseline is held to float32). With ``statistics``, integer and
        bool tensors get float32's tolerance: the dumping side computes their Mean and Norm in floating point.
        """
        tol = self._dtype_tolerance(dtype, statistics)
        skip = False
        for rule in self.apis:
            if rule.matches(api, row):
                if rule.skip:
                    skip = True
                if rule.error is not None:
                    warning = rule.warning if rule.warning is not None else warning_of(rule.error)
                    tol = Tolerance(rule.error, warning, tol.atol if rule.atol is None else rule.atol)
                elif rule.warning is not None or rule.atol is not None:
                    tol = replace(
                        tol,
                        warning=tol.warning if rule.warning is None else rule.warning,
                        atol=tol.atol if rule.atol is None else rule.atol,
                    )
        return tol, skip

    def _dtype_tolerance(self, dtype: str | None, statistics: bool) -> Tolerance:
        cache = self.__dict__.setdefault("_cache", {})  # per instance; not a field, so not compared
        key = (dtype, statistics)
        found = cache.get(key)
        if found is None:
            found = cache[key] = self.for_dtype("float32" if statistics and is_integral(dtype) else dtype)
        return found

    def own_standard(self, api: str, dtype: str | None) -> tuple[float, float, OwnRatios]:
        """The self-check's standard of a call (API rules apply, last match wins): the relative error that
        counts an element as off, the share of its elements that may be, and the ratios its own error may
        be to the baseline's."""
        bound = DEFAULT_OWN_SHARE.get(normalize_dtype(dtype) or "float32", 1e-3)
        share = bound
        level = OWN_LEVEL_OF.get(api.split(".")[1] if api.count(".") >= 1 else api, "L0")
        for rule in self.apis:
            if (rule.own_share is not None or rule.own_level is not None) and rule.matches(api, api):
                share = share if rule.own_share is None else rule.own_share
                level = level if rule.own_level is None else rule.own_level
        return bound, share, OWN_LEVELS[level]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the same shape :func:`load_thresholds_file` reads)."""
        return {
            "dtypes": {
                k: {"error": v.error, "warning": v.warning, "atol": v.atol} for k, v in self.dtypes.items()
            },
            "apis": [
                {k: v for k, v in vars(rule).items() if v is not None and (k != "skip" or v)}
                for rule in self.apis
            ],
            "amplification": self.amplification,
            "msprobe_rule": self.msprobe_rule,
            "max_unmatched": self.max_unmatched,
        }


def _as_float(value: Any, what: str, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {what} must be a number, got {value!r}") from None
    if math.isnan(number) or number < 0:
        raise ConfigError(f"{where}: {what} must be >= 0, got {value!r}")
    return number


def thresholds_from_dict(doc: Any, where: str = "thresholds") -> Thresholds:
    """Thresholds from the JSON form; unknown keys and bad values raise ConfigError naming ``where``."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    unknown = set(doc) - {"dtypes", "apis", "amplification", "msprobe_rule", "max_unmatched"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    dtypes = dict(DEFAULT_DTYPE_TOLERANCES)
    for name, spec in (doc.get("dtypes") or {}).items():
        key = normalize_dtype(name) or name
        if not isinstance(spec, dict) or set(spec) - {"error", "warning", "atol"}:
            raise ConfigError(f"{where}: dtypes.{name} must be an object with error, warning and/or atol")
        base = dtypes.get(key, _F32)
        error = _as_float(spec["error"], f"dtypes.{name}.error", where) if "error" in spec else base.error
        warning = (
            _as_float(spec["warning"], f"dtypes.{name}.warning", where)
            if "warning" in spec
            else (warning_of(error) if "error" in spec else base.warning)
        )
        atol = _as_float(spec["atol"], f"dtypes.{name}.atol", where) if "atol" in spec else base.atol
        dtypes[key] = Tolerance(error, warning, atol)
    rules = []
    for i, spec in enumerate(doc.get("apis") or []):
        if not isinstance(spec, dict) or not isinstance(spec.get("pattern"), str):
            raise ConfigError(f"{where}: apis[{i}] must be an object with a 'pattern' string")
        if set(spec) - {"pattern", "error", "warning", "atol", "skip", "own_share", "own_level"}:
            raise ConfigError(f"{where}: apis[{i}] has unknown key(s) {sorted(set(spec) - {'pattern'})}")
        rules.append(
            ApiRule(
                spec["pattern"],
                error=_as_float(spec["error"], f"apis[{i}].error", where) if "error" in spec else None,
                warning=_as_float(spec["warning"], f"apis[{i}].warning", where)
                if "warning" in spec
                else None,
                atol=_as_float(spec["atol"], f"apis[{i}].atol", where) if "atol" in spec else None,
                skip=bool(spec.get("skip", False)),
                own_share=_as_float(spec["own_share"], f"apis[{i}].own_share", where)
                if "own_share" in spec
                else None,
                own_level=_own_level(spec["own_level"], f"apis[{i}].own_level", where)
                if "own_level" in spec
                else None,
            )
        )
    amplification = _as_float(doc.get("amplification", 10.0), "amplification", where)
    if amplification < 1:
        raise ConfigError(f"{where}: amplification must be >= 1, got {amplification!r}")
    msprobe_rule = doc.get("msprobe_rule", True)
    if not isinstance(msprobe_rule, bool):
        raise ConfigError(f"{where}: msprobe_rule must be true or false, got {msprobe_rule!r}")
    max_unmatched = DEFAULT_MAX_UNMATCHED
    if "max_unmatched" in doc:
        value = doc["max_unmatched"]
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: max_unmatched must be a share such as 0.05 or '5%', got {value!r}")
        try:
            max_unmatched = parse_share(str(value))
        except ValueError as exc:
            raise ConfigError(f"{where}: max_unmatched: {exc}") from None
    return Thresholds(dtypes, tuple(rules), amplification, msprobe_rule, max_unmatched)


def _own_level(value: Any, what: str, where: str) -> str:
    if value not in OWN_LEVELS:
        raise ConfigError(f"{where}: {what} must be one of {', '.join(OWN_LEVELS)}, got {value!r}")
    return str(value)


def load_thresholds_file(path: str | os.PathLike[str]) -> Thresholds:
    return thresholds_from_dict(read_json(path, config_error), os.fspath(path))


def parse_share(text: str) -> float:
    """A share of a whole, written ``5%`` or ``0.05``, as a fraction in [0, 1]; ValueError quoting the text.

    A bare number above 1 is refused rather than read as a percentage: ``5`` could mean either.
    """
    body = text.strip()
    percent = body.endswith("%")
    try:
        value = float(body[:-1] if percent else body)
    except ValueError:
        raise ValueError(f"expected a share such as 5% or 0.05, got {text!r}") from None
    if percent:
        value /= 100
    if math.isnan(value) or not 0 <= value <= 1:
        hint = " (a percentage needs its %: 5%)" if not percent and 1 < value <= 100 else ""
        raise ValueError(f"expected a share between 0 and 100% (0 to 1), got {text!r}{hint}")
    return value


def format_share(share: float) -> str:
    """A share as a percentage for messages: ``77%``, ``5%``, ``2.4%``, ``0.35%``, ``99.6%``."""
    value = share * 100
    if value == 0 or 10 <= value <= 99:
        return f"{value:.0f}%"
    return f"{value:.3g}%" if value > 99 else f"{value:.2g}%"
