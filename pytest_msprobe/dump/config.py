"""Dump settings: explicit arguments and msprobe's ``config.json``, validated into one frozen object.

``config.json`` has msprobe's shape (see ``tests/data/msprobe/msprobe-8.3.3/configs/md5_L1.json``)::

    {"task": "statistics", "dump_path": "./dump", "rank": [], "step": [0, 1], "level": "L1",
     "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "md5"}}

Explicit arguments override the file; every value is checked and a bad one raises :class:`ConfigError` naming
the key, the value and (when it came from a file) the file.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from pytest_msprobe.errors import ConfigError, PathLike
from pytest_msprobe.format.files import config_error, read_json
from pytest_msprobe.settings import LEVELS, TASKS, parse_size

if TYPE_CHECKING:  # pragma: no cover (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

DATA_MODES = ("all", "forward", "backward", "input", "output")
SUMMARY_MODES = ("statistics", "md5")
# msprobe keys that we read elsewhere or that do not change what a dump contains
_KNOWN_TOP_KEYS = frozenset(
    {
        "task",
        "dump_path",
        "rank",
        "step",
        "level",
        "seed",
        "is_deterministic",
        "enable_dataloader",
        "acl_config",
        "framework",
        "async_dump",
        "precision",
        "dump_enable",
        "is_rerun",
        "extra_info",
        "risk_level",
        "custom_op_namespaces",
        "load",
        "self_check",  # ours: replay each API call in float64 and record its own error (self_check.json)
    }
)
# the keys msprobe's task sections take (8.x and 26.x, PyTorch): those every section reads, then each one's own
_SECTION_COMMON_KEYS = frozenset(
    {
        "scope",
        "list",
        "data_mode",
        "summary_mode",
        "file_format",
        "slice",
        "request_id",
        "diff_nums",
        "overflow_nums",
        "check_mode",
        "fuzz_device",
        "pert_mode",
        "handler_type",
        "fuzz_level",
        "fuzz_stage",
        "if_preheat",
        "preheat_step",
        "max_sample",
    }
)
_RUN_UT_KEYS = frozenset(
    {
        "white_list",
        "black_list",
        "error_data_path",
        "master_ip",
        "master_port",
        "is_online",
        "is_benchmark_device",
        "rank_list",
        "nfs_path",
        "host",
        "port",
        "tls_path",
    }
)
_SECTION_KEYS: dict[str, frozenset[str]] = {
    "statistics": frozenset({"tensor_list"}),
    "tensor": frozenset(
        {
            "bench_path",
            "backward_input",
            "online_run_ut",
            "online_run_ut_recompute",
            "nfs_path",
            "host",
            "port",
            "tls_path",
        }
    ),
    "overflow_check": frozenset(),
    "free_benchmark": frozenset(),
    "run_ut": _RUN_UT_KEYS,
    "acc_check": _RUN_UT_KEYS,
    "grad_probe": frozenset({"grad_level", "param_list", "bounds"}),
    "structure": frozenset(),
    "exception_dump": frozenset(),
    "diff_check": frozenset(),
    "nan_check": frozenset({"tensor_list"}),
}
_OTHER_TASK_SECTIONS = frozenset(_SECTION_KEYS)


@dataclass(frozen=True)
class DumpConfig:
    """What to dump and where.

    ``task`` is the task written in dump.json (``statistics``, ``tensor`` or ``overflow_check``); ``summary_mode``
    ``md5`` adds a CRC32 of every tensor (task ``md5`` in our arguments is ``statistics`` + ``md5``). ``steps`` /
    ``ranks`` of ``None`` mean every step / rank. ``data_mode`` is the set of the four directions kept.
    ``overflow_nums`` (task ``overflow_check``): how many overflowing calls the dump keeps before it keeps no
    more, -1 for all of them (msprobe's setting, default 1).
    """

    dump_path: Path
    task: str = "statistics"
    summary_mode: str = "statistics"
    level: str = "L1"
    steps: frozenset[int] | None = None
    ranks: frozenset[int] | None = None
    scope: tuple[str, ...] = ()
    api_list: tuple[str, ...] = ()
    data_mode: frozenset[str] = frozenset({"forward", "backward", "input", "output"})
    max_dump_size: int | None = None  # bytes of tensor files the dump may take (None: no limit)
    self_check: bool = False  # replay each API call in float64 and record its own error (self_check.json)
    overflow_nums: int = 1  # task overflow_check: overflowing calls kept (-1: all)

    @property
    def md5(self) -> bool:
        return self.summary_mode == "md5"

    @property
    def save_tensors(self) -> bool:
        return self.task == "tensor"

    @property
    def overflow_check(self) -> bool:
        """Whether only the calls whose outputs hold inf/nan are written (task ``overflow_check``)."""
        return self.task == "overflow_check"

    @property
    def modules(self) -> bool:
        """Whether modules are captured (levels L0 and mix)."""
        return self.level in ("L0", "mix")

    @property
    def apis(self) -> bool:
        """Whether APIs are captured (levels L1 and mix)."""
        return self.level in ("L1", "mix")

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _check_choice(key: str, value: Any, choices: Iterable[str], source: str | None) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key}={value!r}{_where(source)}: expected one of {', '.join(choices)}")
    return value


def _check_str_list(key: str, value: Any, source: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}={value!r}{_where(source)}: expected a list of non-empty strings")
    return tuple(value)


def _parse_int_set(key: str, value: Any, source: str | None) -> frozenset[int] | None:
    """A step/rank list: ints and "a-b" ranges; empty or None means all."""
    if value is None:
        return None
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset, range)):
        raise ConfigError(f"{key}={value!r}{_where(source)}: expected a list of non-negative integers")
    out: set[int] = set()
    for item in value:
        if isinstance(item, bool):
            raise ConfigError(f"{key}={value!r}{_where(source)}: {item!r} is not an integer")
        if isinstance(item, int):
            if item < 0:
                raise ConfigError(f"{key}={value!r}{_where(source)}: {item} is negative")
            out.add(item)
            continue
        if isinstance(item, str):
            text = item.strip()
            lo, sep, hi = text.partition("-")
            try:
                first, last = (int(text), int(text)) if not sep else (int(lo), int(hi))
            except ValueError:
                raise ConfigError(
                    f"{key}={value!r}{_where(source)}: {item!r} is neither an integer nor a range 'a-b'"
                ) from None
            if first < 0 or last < first:
                raise ConfigError(f"{key}={value!r}{_where(source)}: bad range {item!r}")
            out.update(range(first, last + 1))
            continue
        raise ConfigError(f"{key}={value!r}{_where(source)}: {item!r} is not an integer")
    return frozenset(out) if out else None


def _parse_data_mode(value: Any, source: str | None) -> frozenset[str]:
    if value is None:
        value = ["all"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"data_mode={value!r}{_where(source)}: expected a non-empty list of {DATA_MODES}")
    for item in value:
        _check_choice("data_mode", item, DATA_MODES, source)
    if "all" in value:
        if len(value) > 1:
            raise ConfigError(
                f"data_mode={value!r}{_where(source)}: 'all' cannot be combined with other modes"
            )
        return frozenset({"forward", "backward", "input", "output"})
    modes = set(value)
    # as msprobe: naming only directions keeps both inputs and outputs, and the other way round
    if not modes & {"forward", "backward"}:
        modes |= {"forward", "backward"}
    if not modes & {"input", "output"}:
        modes |= {"input", "output"}
    return frozenset(modes)


def read_config_file(config_path: PathLike) -> dict[str, Any]:
    """Read an msprobe ``config.json`` into a dict; a missing or malformed file raises ConfigError."""
    path = os.fspath(config_path)
    if not os.path.lexists(path):
        raise ConfigError(f"{path}: config file not found")
    data = read_json(path, config_error)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _unknown_key(key: str, known: Iterable[str], where: str) -> str:
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{where}: ignoring unknown key {key!r}{hint}"


def _warn_unknown_keys(file_data: dict[str, Any], source: str) -> None:
    """Warn of every key msprobe would not read, at the top level and in each task section, naming the file,
    the section and the nearest known key: a misspelt key (``summary_mod``) would otherwise change nothing, in
    silence."""
    top = _KNOWN_TOP_KEYS | _OTHER_TASK_SECTIONS
    for key in file_data:
        if key not in top:
            warnings.warn(_unknown_key(key, top, source), stacklevel=4)
    for name, known in _SECTION_KEYS.items():
        section = file_data.get(name)
        if not isinstance(section, dict):
            continue  # (the section of the task in use is checked where it is read)
        keys = _SECTION_COMMON_KEYS | known
        for key in section:
            if key not in keys:
                warnings.warn(_unknown_key(key, keys, f"{source}: section {name!r}"), stacklevel=4)


class DumpArgs(TypedDict, total=False):
    """The keyword settings that :class:`~pytest_msprobe.dump.debugger.PrecisionDebugger` hands on to
    :func:`build_config` as given; None or left out: from config.json, else the default."""

    rank: Any
    scope: list[str] | None
    data_mode: list[str] | None
    summary_mode: str | None
    max_dump_size: int | str | None
    self_check: bool | None
    overflow_nums: int | None


def build_config(
    config_path: PathLike | None = None,
    *,
    task: str | None = None,
    dump_path: PathLike | None = None,
    level: str | None = None,
    step: Any = None,
    api_list: list[str] | None = None,
    **given: Unpack[DumpArgs],
) -> DumpConfig:
    """Merge a config file (optional) with explicit arguments (which win) into a validated DumpConfig."""
    source = os.fspath(config_path) if config_path is not None else None
    file_data: dict[str, Any] = read_config_file(config_path) if config_path is not None else {}
    if source is not None:
        _warn_unknown_keys(file_data, source)

    def pick(key: str, explicit: Any, default: Any = None) -> tuple[Any, str | None]:
        if explicit is not None:
            return explicit, None
        if key in file_data:
            return file_data[key], source
        return default, None

    task_value, task_src = pick("task", task, "statistics")
    task_value = _check_choice("task", task_value, TASKS, task_src)
    level_value, level_src = pick("level", level, "L1")
    level_value = _check_choice("level", level_value, LEVELS, level_src)

    path_value, path_src = pick("dump_path", dump_path, None)
    if path_value is None:
        raise ConfigError("dump_path is not set: pass dump_path= or give it in config.json")
    if not isinstance(path_value, (str, os.PathLike)) or not os.fspath(path_value):
        raise ConfigError(f"dump_path={path_value!r}{_where(path_src)}: expected a non-empty path")

    step_value, step_src = pick("step", step)
    rank_value, rank_src = pick("rank", given.get("rank"))

    # the per-task section: "statistics" holds the md5 switch, as in msprobe
    section_name = task_value if task_value in ("tensor", "overflow_check") else "statistics"
    section = file_data.get(section_name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{section_name}={section!r}{_where(source)}: expected a JSON object")

    def pick_section(key: str, explicit: Any) -> tuple[Any, str | None]:
        if explicit is not None:
            return explicit, None
        if key in section:
            return section[key], source
        return None, None

    scope_value, scope_src = pick_section("scope", given.get("scope"))
    scope_tuple = _check_str_list("scope", scope_value, scope_src)
    if len(scope_tuple) > 2:
        raise ConfigError(
            f"scope={list(scope_tuple)!r}{_where(scope_src)}: expected at most two names (the first and the last "
            "record of the range)"
        )
    list_value, list_src = pick_section("list", api_list)
    list_tuple = _check_str_list("list", list_value, list_src)
    mode_value, mode_src = pick_section("data_mode", given.get("data_mode"))
    modes = _parse_data_mode(mode_value, mode_src)

    summary_value, summary_src = pick_section("summary_mode", given.get("summary_mode"))
    if task_value == "md5":
        if summary_value not in (None, "md5"):
            raise ConfigError(
                f"summary_mode={summary_value!r}{_where(summary_src)}: task 'md5' implies 'md5'"
            )
        task_value, summary_value = "statistics", "md5"
    elif summary_value is None:
        summary_value = "statistics"
    else:
        summary_value = _check_choice("summary_mode", summary_value, SUMMARY_MODES, summary_src)
        if task_value in ("tensor", "overflow_check") and summary_value == "md5":
            raise ConfigError(f"summary_mode='md5'{_where(summary_src)}: only valid with task 'statistics'")

    nums_value, nums_src = pick_section("overflow_nums", given.get("overflow_nums"))
    if nums_value is None:
        nums_value = 1
    if (
        isinstance(nums_value, bool)
        or not isinstance(nums_value, int)
        or not (nums_value == -1 or nums_value >= 1)
    ):
        raise ConfigError(
            f"overflow_nums={nums_value!r}{_where(nums_src)}: expected the number of overflowing calls to keep "
            "(1 or more), or -1 for all of them"
        )

    check_value, check_src = pick("self_check", given.get("self_check"), False)
    if not isinstance(check_value, bool):
        raise ConfigError(f"self_check={check_value!r}{_where(check_src)}: expected true or false")
    if check_value and level_value == "L0":
        raise ConfigError(
            f"self_check{_where(check_src)} replays API calls: it needs level L1 or mix, not L0 (modules only)"
        )

    return DumpConfig(
        dump_path=Path(os.path.abspath(os.fspath(path_value))),
        task=task_value,
        summary_mode=summary_value,
        level=level_value,
        steps=_parse_int_set("step", step_value, step_src),
        ranks=_parse_int_set("rank", rank_value, rank_src),
        scope=scope_tuple,
        api_list=list_tuple,
        data_mode=modes,
        max_dump_size=None
        if (size := given.get("max_dump_size")) is None
        else parse_size(size, "max_dump_size"),
        self_check=check_value,
        overflow_nums=nums_value,
    )
