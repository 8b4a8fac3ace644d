"""What a run is told: the session's and one test's settings, and the checks every given value goes through.

The values come from :mod:`pytest_msprobe.options`, which resolves them (command line > marker > ini > default)
and calls the checks below with where each value was given, so that a bad one raises ConfigError quoting both.
Like the options, this module stands on the ground floor: it imports only the errors and the thresholds' data,
so that the run, the reports and the plugin all read it and it reads none of them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.thresholds import (
    DEFAULT_DTYPE_TOLERANCES,
    Thresholds,
    normalize_dtype,
    parse_share,
)

_N = TypeVar("_N", int, float)
DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")  # what --msprobe-device takes (run.device picks one)
# what a dump records (task) and at which level: APIs (L1), modules (L0) or both (mix), msprobe's words
TASKS = ("statistics", "tensor", "md5", "overflow_check")
LEVELS = ("L0", "L1", "mix")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# seconds the rank processes of a multi-rank test may take once they have all joined the process group (their
# start-up has a limit of its own, RANK_STARTUP): a collective that one rank never
# joins hangs the others for good, and a CI job should fail long before its own limit kills everything
DEFAULT_RANK_TIMEOUT = 600.0
# seconds a rank's start-up (Python, torch, the conftest files, joining the process group) may take beyond the
# rank timeout; the process group's own timeout is as long, so that a collective never gives up before the
# launcher stops a hung rank
RANK_STARTUP = 300.0


@dataclass(frozen=True)
class SessionSettings:
    """Settings that hold for the whole pytest session."""

    baseline: Path | None  # None: compare nothing, the plugin stays out of the way
    regen: bool
    output: Path
    device: str
    keep_dumps: bool = False  # keep the dumps of passing tests and regenerated baselines
    report_only: bool = False  # the command line's or the ini's report-only mode (a marker may differ)

    @property
    def active(self) -> bool:
        return self.baseline is not None


@dataclass(frozen=True)
class TestSettings:
    """Settings of one msprobe test."""

    task: str
    level: str
    steps: tuple[int, ...]
    seed: int
    thresholds: Thresholds
    max_dump_size: int | None = None  # bytes of tensor files the test's dump may take (None: no limit)
    world_size: int = 1  # > 1: the test body runs in that many rank processes under torch.distributed
    backend: str | None = None  # torch.distributed backend of the ranks; None: by device (gloo, nccl, hccl)
    rank_timeout: float = DEFAULT_RANK_TIMEOUT  # seconds the rank processes may take once all have started
    self_check: bool = False  # replay each API call in float64 and fail on one whose own error is out of line
    checklist_env: tuple[str, ...] = ()  # environment variables the checklist records beyond its own list
    trend_steps: int | None = None  # record and compare the loss and gradient norms of steps 0..N-1
    trend_rtol: float | None = None  # the trend's relative tolerance; None: by the training dtype
    report_only: bool = False  # a precision verdict is recorded and reported, never a failure of the test
    # leave TF32 / HF32 as the device and the test have them, instead of float32 math in float32 everywhere
    allow_tf32: bool = False


def check_flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_names(value: Any, where: str) -> tuple[str, ...]:
    """Environment variable names: a list, or text with one name per line or separated by spaces/commas."""
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{where}: expected environment variable names, got {value!r}")
    names = []
    for item in items:
        for name in str(item).replace(",", " ").split():
            if not _ENV_NAME.fullmatch(name):
                raise ConfigError(f"{where}: {name!r} is not an environment variable name")
            names.append(name)
    return tuple(dict.fromkeys(names))


def check_given(value: Any, where: str) -> str:
    """An option's text, refused when empty: ``--msprobe-baseline=`` is what an unset CI variable gives, and
    taking it for "no baseline" would turn the gate off without a word."""
    text = os.fspath(value)
    if not text.strip():
        raise ConfigError(
            f"{where} is empty (an unset variable in the CI script?): give a folder, or leave the option out"
        )
    return text


def check_device(value: Any, where: str) -> str:
    device = str(value).strip()
    if device.partition(":")[0].lower() not in DEVICE_CHOICES:
        raise ConfigError(f"{where}: unknown device {device!r}, expected one of {', '.join(DEVICE_CHOICES)}")
    return device


def check_choice(value: Any, choices: tuple[str, ...], what: str, where: str) -> str:
    if value not in choices:
        raise ConfigError(f"{where}: {what} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def check_steps(value: Any, where: str) -> tuple[int, ...]:
    items: Any = value.replace(",", " ").split() if isinstance(value, str) else value
    if isinstance(items, int) and not isinstance(items, bool):
        items = [items]
    try:
        steps = tuple(sorted({int(s) for s in items}))
        if any(isinstance(s, bool) or (isinstance(s, float) and not s.is_integer()) for s in items):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: steps must be non-negative integers, got {value!r}") from None
    if not steps or steps[0] < 0:
        raise ConfigError(f"{where}: steps must be non-negative integers, got {value!r}")
    return steps


def _number(value: Any, parse: Callable[[Any], _N], where: str, expected: str) -> _N:
    """``parse(value)``, or ConfigError saying what was ``expected``: a bool is no number, though Python's
    int() and float() take one."""
    try:
        if isinstance(value, bool):
            raise ValueError
        return parse(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {expected}, got {value!r}") from None


def check_seed(value: Any, where: str) -> int:
    seed = _number(value, int, where, "seed must be an integer")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"{where}: seed must be in [0, 2**32), got {value!r}")
    return seed


def check_world_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: world_size must be an integer >= 1, got {value!r}")
    return value


def check_backend(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where}: backend must be a torch.distributed backend name (gloo, nccl, hccl...), got {value!r}"
        )
    return value.strip().lower()


def check_trend_steps(value: Any, where: str) -> int | None:
    if value is None:
        return None
    expected = "trend_steps must be a whole number >= 1"
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{where}: {expected}, got {value!r}")
    steps = _number(value.strip() if isinstance(value, str) else value, int, where, expected)
    if steps < 1:
        raise ConfigError(f"{where}: {expected}, got {value!r}")
    return steps


def check_trend_rtol(value: Any, where: str) -> float | None:
    if value is None:
        return None
    rtol = _number(value, float, where, "trend_rtol must be a number >= 0")
    if not rtol >= 0 or math.isinf(rtol):
        raise ConfigError(f"{where}: trend_rtol must be a number >= 0, got {value!r}")
    return rtol


def check_seconds(value: Any, where: str) -> float:
    seconds = _number(value, float, where, "expected a number of seconds")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return seconds


def check_apart(output: Path, baseline: Path, what: str = "the output folder", flag: str | None = "") -> None:
    """Refuse an output folder that is, holds or lies inside a baseline folder: a run clears its output
    folders, and would delete the baselines it is meant to compare with. ``flag`` is the option that moves it."""
    out, base = Path(os.path.realpath(output)), Path(os.path.realpath(baseline))
    if out == base or out.is_relative_to(base) or base.is_relative_to(out):
        relation = "is" if out == base else "lies inside" if out.is_relative_to(base) else "holds"
        raise ConfigError(
            f"{what} {output} {relation} the baseline folder {baseline}: the run would delete baselines; "
            f"give {flag} a folder of its own"
        )


# the threshold options' command-line text, as argparse's ``type=`` reads it (and the plugin reads ini lines and
# marker values): errors are argparse's, which the options module turns into ConfigError naming where
def parse_number(text: str, minimum: float = 0, whole: bool = False) -> float:
    """A number at least ``minimum`` (a whole one with ``whole``), for argparse's ``type=``."""
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a {'whole ' if whole else ''}number, got {text!r}"
        ) from None
    if math.isnan(value) or value < minimum:
        raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text!r}")
    return value


def parse_nonnegative(text: str) -> float:
    return parse_number(text)


def parse_amplification(text: str) -> float:
    value = parse_nonnegative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def parse_share_option(text: str) -> float:
    try:
        return parse_share(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_pair(text: str) -> tuple[str, float]:
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}")
    return key, parse_nonnegative(value)


def parse_dtype_pair(text: str) -> tuple[str, float]:
    key, value = parse_pair(text)
    name = normalize_dtype(key)
    if name not in DEFAULT_DTYPE_TOLERANCES:
        known = ", ".join(sorted(DEFAULT_DTYPE_TOLERANCES))
        raise argparse.ArgumentTypeError(f"unknown dtype {key!r} in {text!r} (known: {known})")
    return str(name), value


def parse_size(value: Any, where: str) -> int:
    """A size in bytes from ``500MB``, ``2GiB``, ``1.5 GB`` or a plain number of bytes (kB, MB... are powers of
    1000, KiB, MiB... of 1024); ``where`` names the setting in the error.

        >>> parse_size("500MB", "max_dump_size"), parse_size("2GiB", "max_dump_size"), parse_size(4096, "x")
        (500000000, 2147483648, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected a size such as 500MB, 2GiB or a number of bytes, got {value!r}")
    if isinstance(value, str):
        m = _SIZE.match(value)
        factor = _SIZE_UNITS.get(m.group(2).lower()) if m else None
        if m is None or factor is None:
            raise ConfigError(
                f"{where}: expected a size such as 500MB, 2GiB or a number of bytes "
                f"(units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
            )
        number = float(m.group(1)) * factor
    else:
        number = float(value)
    if not math.isfinite(number) or number < 1:
        raise ConfigError(f"{where}: the size must be at least 1 byte, got {value!r}")
    return int(number)


def format_size(size: int) -> str:
    """A byte count as people write it: ``2 GiB`` when it is a whole number of binary units, else ``500 MB``."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= factor:
            return f"{size / factor:.4g} {unit}"
    return f"{size} B"
