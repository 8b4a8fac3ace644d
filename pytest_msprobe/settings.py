"""Settings of a pytest-msprobe run, resolved in one place: command line > marker > ini > default.

Session settings (where baselines and outputs live, whether to regenerate, which device) come from the command
line or the ini file. Per-test settings (task, level, steps, seed, thresholds, ranks) come from the test's
``@pytest.mark.msprobe(...)`` marker, with ini defaults below it and the threshold options of the command line
above it. Every value is validated here; a bad one raises ConfigError quoting the value and where it was given.
This module does not import pytest: the plugin hands it getters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.thresholds import Thresholds, parse_threshold_value, thresholds_from_options
from pytest_msprobe.dump.config import parse_size
from pytest_msprobe.errors import ConfigError
from pytest_msprobe.run.device import DEVICE_CHOICES

TASKS = ("statistics", "tensor", "md5")
LEVELS = ("L0", "L1", "mix")
DEFAULT_TASK, DEFAULT_LEVEL, DEFAULT_STEPS, DEFAULT_SEED = "statistics", "L1", (0, 1), 1234
DEFAULT_OUTPUT = "msprobe-output"
# seconds the rank processes of a multi-rank test may take, start-up included: a collective that one rank never
# joins hangs the others for good, and a CI job should fail long before its own limit kills everything
DEFAULT_RANK_TIMEOUT = 600.0

# threshold settings: option destination (without prefix) -> what it is, for ini help texts
THRESHOLD_SETTINGS = {
    "rtol": "error tolerance (scaled error) of every floating dtype",
    "warn_rtol": "warning level (scaled error) of every floating dtype",
    "atol": "absolute differences at or below this never count",
    "dtype_rtol": "lines of DTYPE=FLOAT: error tolerance of one dtype",
    "api_rtol": "lines of GLOB=FLOAT: error tolerance of matching APIs or rows",
    "skip_api": "lines of GLOB: report matching APIs but never fail on them",
    "amplification": "output/input error ratio that places the first divergence when errors flow in",
    "max_unmatched": "most of a dump pair's baseline rows that may find no partner in the target (5% or 0.05)",
    "thresholds": "JSON file of thresholds",
}
MARKER_KEYS = frozenset(
    {
        "task",
        "level",
        "steps",
        "seed",
        "msprobe_rule",
        "max_dump_size",
        "world_size",
        "backend",
        "rank_timeout",
        *THRESHOLD_SETTINGS,
    }
)

# ini keys (all strings) -> help; the plugin registers them
INI_KEYS = {
    "msprobe_baseline": "folder of baselines; enables the precision comparison (--msprobe-baseline)",
    "msprobe_regen_baseline": "true: write the baselines instead of comparing (--msprobe-regen-baseline)",
    "msprobe_output": f"folder for this run's dumps and reports (default: {DEFAULT_OUTPUT})",
    "msprobe_device": "auto, cpu, cuda or npu (default: auto)",
    "msprobe_task": f"default task of msprobe tests: {', '.join(TASKS)} (default: {DEFAULT_TASK})",
    "msprobe_level": f"default level of msprobe tests: {', '.join(LEVELS)} (default: {DEFAULT_LEVEL})",
    "msprobe_steps": "default dumped steps of msprobe tests, e.g. '0 1' (default: 0 1)",
    "msprobe_seed": f"default seed of msprobe tests (default: {DEFAULT_SEED})",
    "msprobe_max_dump_size": "most a test's tensor files may take, e.g. 500MB or 2GiB (--msprobe-max-dump-size)",
    "msprobe_keep_dumps": "true: keep the dumps of passing tests and regenerated baselines (--msprobe-keep-dumps)",
    "msprobe_rank_timeout": "seconds the rank processes of a multi-rank test may take "
    f"(--msprobe-rank-timeout; default: {DEFAULT_RANK_TIMEOUT:g})",
    **{f"msprobe_{name}": text for name, text in THRESHOLD_SETTINGS.items()},
}

Getter = Callable[[str], Any]


@dataclass(frozen=True)
class SessionSettings:
    """Settings that hold for the whole pytest session."""

    baseline: Path | None  # None: compare nothing, the plugin stays out of the way
    regen: bool
    output: Path
    device: str
    keep_dumps: bool = False  # keep the dumps of passing tests and regenerated baselines

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
    rank_timeout: float = DEFAULT_RANK_TIMEOUT  # seconds the rank processes may take, start-up included


def _truthy(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _path(value: Any, base: Path) -> Path:
    path = Path(os.path.expanduser(os.fspath(value)))
    return path if path.is_absolute() else base / path


def _given(value: Any, where: str) -> str:
    """An option's text, refused when empty: ``--msprobe-baseline=`` is what an unset CI variable gives, and
    taking it for "no baseline" would turn the gate off without a word."""
    text = os.fspath(value)
    if not text.strip():
        raise ConfigError(
            f"{where} is empty (an unset variable in the CI script?): give a folder, or leave the option out"
        )
    return text


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_apart(output: Path, baseline: Path, what: str = "the output folder") -> None:
    """Refuse an output folder that is, holds or lies inside a baseline folder: a run clears its output
    folders, and would delete the baselines it is meant to compare with."""
    out, base = _real(output), _real(baseline)
    if out == base or out.is_relative_to(base) or base.is_relative_to(out):
        relation = "is" if out == base else "lies inside" if out.is_relative_to(base) else "holds"
        raise ConfigError(
            f"{what} {output} {relation} the baseline folder {baseline}: the run would delete baselines; "
            "give --msprobe-output a folder of its own"
        )


def _folder_option(
    key: str, cli: Getter, ini: Getter, invocation_dir: Path, ini_dir: Path
) -> tuple[Path | None, str]:
    """A folder option and where it came from: the command line (relative to where pytest was started), else the
    ini file (relative to it, and set even to nothing), else (None, "")."""
    flag = "--" + key.replace("_", "-")
    value = cli(key)
    if value is not None:
        return _path(_given(value, flag), invocation_dir), flag
    value = ini(key)
    if isinstance(value, str):
        return _path(_given(value, f"ini {key}"), ini_dir), f"ini {key}"
    return None, ""


def resolve_session(cli: Getter, ini: Getter, invocation_dir: Path, ini_dir: Path) -> SessionSettings:
    """Session settings; command-line paths are relative to where pytest was started, ini paths to the ini file."""
    baseline, _ = _folder_option("msprobe_baseline", cli, ini, invocation_dir, ini_dir)
    regen = bool(cli("msprobe_regen_baseline")) or _truthy(
        ini("msprobe_regen_baseline") or False, "ini msprobe_regen_baseline"
    )
    output, output_from = _folder_option("msprobe_output", cli, ini, invocation_dir, ini_dir)
    if output is None:
        output, output_from = _path(DEFAULT_OUTPUT, ini_dir), f"the output folder (default {DEFAULT_OUTPUT})"
    if cli("msprobe_device") is not None:
        _given(cli("msprobe_device"), "--msprobe-device")
    device = str(cli("msprobe_device") or ini("msprobe_device") or "auto").strip()
    if device.partition(":")[0].lower() not in DEVICE_CHOICES:
        where = "--msprobe-device" if cli("msprobe_device") else "ini msprobe_device"
        raise ConfigError(f"{where}: unknown device {device!r}, expected one of {', '.join(DEVICE_CHOICES)}")
    if regen and baseline is None:
        raise ConfigError("--msprobe-regen-baseline needs --msprobe-baseline=DIR (or ini msprobe_baseline)")
    if baseline is not None and os.path.exists(baseline) and not os.path.isdir(baseline):
        raise ConfigError(f"the baseline folder {baseline} is a file, not a folder")
    if baseline is not None:
        check_apart(output, baseline, output_from)
    keep_dumps = bool(cli("msprobe_keep_dumps")) or _truthy(
        ini("msprobe_keep_dumps") or False, "ini msprobe_keep_dumps"
    )
    # resolved per test (a marker sits between them), checked here so that a bad value stops the run at once
    if cli("msprobe_max_dump_size"):
        parse_size(cli("msprobe_max_dump_size"), "--msprobe-max-dump-size")
    if ini("msprobe_max_dump_size"):
        parse_size(ini("msprobe_max_dump_size"), "ini msprobe_max_dump_size")
    if cli("msprobe_rank_timeout") is not None:
        _seconds(cli("msprobe_rank_timeout"), "--msprobe-rank-timeout")
    if ini("msprobe_rank_timeout"):
        _seconds(ini("msprobe_rank_timeout"), "ini msprobe_rank_timeout")
    return SessionSettings(
        baseline=baseline, regen=regen, output=output, device=device, keep_dumps=keep_dumps
    )


def _steps(value: Any, where: str) -> tuple[int, ...]:
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


def _choice(value: Any, choices: tuple[str, ...], what: str, where: str) -> str:
    if value not in choices:
        raise ConfigError(f"{where}: {what} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _seed(value: Any, where: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        seed = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: seed must be an integer, got {value!r}") from None
    if not 0 <= seed < 2**32:
        raise ConfigError(f"{where}: seed must be in [0, 2**32), got {value!r}")
    return seed


def _world_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: world_size must be an integer >= 1, got {value!r}")
    return value


def _backend(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where}: backend must be a torch.distributed backend name (gloo, nccl, hccl...), got {value!r}"
        )
    return value.strip().lower()


def _seconds(value: Any, where: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return seconds


def resolve_test(
    cli: Getter, marker: Mapping[str, Any], ini: Getter, ini_dir: Path, test: str = "this test"
) -> TestSettings:
    """Per-test settings from the marker's keywords, with ini defaults below and CLI thresholds above."""
    unknown = set(marker) - MARKER_KEYS
    if unknown:
        raise ConfigError(
            f"@pytest.mark.msprobe on {test}: unknown keyword(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(MARKER_KEYS))})"
        )
    where_marker = f"@pytest.mark.msprobe on {test}"

    def layered(key: str, ini_key: str) -> tuple[Any, str] | None:
        if key in marker:
            return marker[key], where_marker
        raw = ini(ini_key)
        if raw not in (None, "", []):
            return raw, f"ini {ini_key}"
        return None

    task_v = layered("task", "msprobe_task")
    level_v = layered("level", "msprobe_level")
    steps_v = layered("steps", "msprobe_steps")
    seed_v = layered("seed", "msprobe_seed")
    task = _choice(task_v[0], TASKS, "task", task_v[1]) if task_v else DEFAULT_TASK
    level = _choice(level_v[0], LEVELS, "level", level_v[1]) if level_v else DEFAULT_LEVEL
    steps = _steps(*steps_v) if steps_v else DEFAULT_STEPS
    seed = _seed(*seed_v) if seed_v else DEFAULT_SEED
    size_cli = cli("msprobe_max_dump_size")
    size_v = (
        (size_cli, "--msprobe-max-dump-size")
        if size_cli
        else layered("max_dump_size", "msprobe_max_dump_size")
    )
    if size_v is not None and size_v[1] == where_marker:
        size_v = (size_v[0], f"{where_marker}: max_dump_size")
    # a marker's max_dump_size=None lifts the ini's limit for that test
    max_dump_size = parse_size(*size_v) if size_v is not None and size_v[0] is not None else None
    world_size = _world_size(marker["world_size"], where_marker) if "world_size" in marker else 1
    backend = _backend(marker.get("backend"), where_marker)
    timeout_cli = cli("msprobe_rank_timeout")
    timeout_v = (
        (timeout_cli, "--msprobe-rank-timeout")
        if timeout_cli is not None
        else layered("rank_timeout", "msprobe_rank_timeout")
    )
    if timeout_v is not None and timeout_v[1] == where_marker:
        timeout_v = (timeout_v[0], f"{where_marker}: rank_timeout")
    rank_timeout = _seconds(*timeout_v) if timeout_v is not None else DEFAULT_RANK_TIMEOUT

    options: dict[str, Any] = {}
    for name in THRESHOLD_SETTINGS:
        from_cli = cli(f"msprobe_{name}")
        if from_cli not in (None, []):
            options[name] = from_cli
            continue
        found = layered(name, f"msprobe_{name}")
        if found is not None:
            value, where = found
            if where.startswith("ini"):
                value = _path(value, ini_dir) if name == "thresholds" else value
            else:
                where = f"{where}: {name}"
            options[name] = parse_threshold_value(name, value, where)
    if cli("msprobe_no_msprobe_rule"):
        options["no_msprobe_rule"] = True
    elif "msprobe_rule" in marker:
        options["no_msprobe_rule"] = not _truthy(marker["msprobe_rule"], f"{where_marker}: msprobe_rule")
    return TestSettings(
        task,
        level,
        steps,
        seed,
        thresholds_from_options(options),
        max_dump_size,
        world_size=world_size,
        backend=backend,
        rank_timeout=rank_timeout,
    )
