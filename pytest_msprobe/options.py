"""Every option of pytest-msprobe in one table, and everything generated from it.

Each :class:`Option` names its pytest command-line flag, ini key and marker keyword (nowhere else spells
them), its parser, default and help. From the table come pytest's ``addoption``/``addini``
(:func:`add_pytest_options`), the marker's known keywords, the ``pytest-msprobe compare`` arguments it shares
(:func:`add_threshold_options`) and the resolution of a session's and a test's settings
(:func:`resolve_session`, :func:`resolve_test`).

Precedence: the highest layer that gives a setting wins, layers being the command line > the test's marker >
the ini file > a thresholds file (``thresholds=``) > the built-in defaults. The tolerance of a dtype is one
setting: for each dtype, the highest layer that says anything about it decides all of it. A global ``rtol``,
``warn_rtol`` or ``atol`` speaks for every floating dtype of its layer, and within one layer a per-dtype
``dtype_rtol`` beats it. So ``--msprobe-rtol 0.5`` with a marker's ``dtype_rtol={"float32": 1e-3}`` holds
float32 and float16 to 0.5; the marker alone holds float32 to 1e-3. Scalars (``amplification``,
``max_unmatched``...) and lists (``api_rtol``, ``skip_api``) are taken whole from the highest layer that gives
them.

A bad value raises ConfigError quoting it and where it came from; a value that a higher layer overrides is
never checked, as it never counts. This module imports neither pytest (the plugin hands it pytest's parser and
getters) nor torch.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_msprobe import settings
from pytest_msprobe.errors import ConfigError
from pytest_msprobe.settings import (
    DEFAULT_RANK_TIMEOUT,
    LEVELS,
    RANK_STARTUP,
    TASKS,
    SessionSettings,
    TestSettings,
    check_apart,
    parse_size,
)
from pytest_msprobe.thresholds import (
    FLOATING,
    ApiRule,
    Thresholds,
    Tolerance,
    load_thresholds_file,
    warning_of,
)

Getter = Callable[[str], Any]
Check = Callable[[Any, str], Any]  # (value, where it was given) -> the value, or ConfigError quoting both


@dataclass(frozen=True)
class Option:
    """One setting: where it may be given, how its values are read, its default. :meth:`flag_help` and
    :meth:`ini_text` end ``help`` and ``ini_help`` with where else the setting is given, and its default."""

    name: str  # what resolution calls it; the offline ``pytest-msprobe compare`` takes a shared one as --NAME
    flag: str | None = None  # pytest's command-line flag; its destination is the flag in underscores
    ini: str | None = None
    marker: str | None = None  # keyword of @pytest.mark.msprobe
    default: Any = None  # below every layer
    help: str = ""
    ini_help: str = ""  # the ini key's, where the command line's help will not do (it names the metavar)
    metavar: str | None = None
    action: str | None = None  # argparse's: store_true, append
    type: Callable[[str], Any] | None = None  # argparse's parser of command-line text
    # reads marker and ini values, and command-line text argparse left as text (shared: as argparse would)
    check: Check | None = None
    ini_type: str = "string"
    shared: bool = False  # a threshold option: the offline CLI takes it too
    # paths from the command line start where pytest started, from the ini at the ini file; an ini key set to
    # nothing is given (its check refuses it: "unset" would turn the gate off without a word): ini default None
    folder: bool = False
    blank_cli: str = "value"  # an empty command-line value is a "value", "refused" or "unset"
    ini_path: bool = False  # a file: an ini value is relative to the ini file
    check_names_it: bool = False  # the check's messages name the keyword: a marker's "where" need not
    marker_value: str = ""  # the help gives the marker this value (a switch it turns the other way)

    @property
    def dest(self) -> str:
        assert self.flag is not None
        return self.flag[2:].replace("-", "_")

    @property
    def default_note(self) -> str | None:
        """``default: VALUE`` for the help; None where there is no value to show (a switch, unset, empty)."""
        if self.action is not None or self.default is None or self.default is False or self.default == ():
            return None
        if isinstance(self.default, tuple):
            return "default: " + " ".join(map(str, self.default))
        return f"default: {format(self.default, 'g') if isinstance(self.default, float) else self.default}"

    def flag_help(self, elsewhere: bool = True) -> str:
        """The command-line help; ``elsewhere``: with the default, the ini key and the marker keyword."""
        if self.help == argparse.SUPPRESS or not elsewhere:
            return self.help
        ini = f"ini: {self.ini}" if self.ini else None
        marker = f"marker: {self.marker}={self.marker_value}" if self.marker else None
        return _ending(self.help, [self.default_note, ini, marker])

    def ini_text(self) -> str:
        """The ini key's help, with the flag and the default."""
        text = ("true: " if self.action == "store_true" else "") + (self.ini_help or self.help)
        return _ending(text, [self.flag, self.default_note])


def _ending(text: str, where: list[str | None]) -> str:
    given = [w for w in where if w]
    return f"{text} ({'; '.join(given)})" if given else text


def _size(value: Any, where: str) -> int | None:
    return None if value is None else parse_size(value, where)  # a marker's None lifts the ini's limit


def _choice(choices: tuple[str, ...], what: str) -> Check:
    return lambda value, where: settings.check_choice(value, choices, what, where)


def _shared(name: str, **fields: Any) -> Option:
    """A threshold option: the offline CLI takes it too. Its flag, ini key and marker keyword are its name
    (``rtol``: ``--msprobe-rtol``, ``msprobe_rtol``, ``rtol=``) unless ``fields`` say otherwise."""
    spelled = {"flag": "--msprobe-" + name.replace("_", "-"), "ini": "msprobe_" + name, "marker": name}
    return Option(name, shared=True, **{**spelled, **fields})


def _switch(name: str, **fields: Any) -> Option:
    """An on/off option: a bare flag on the command line, true or false in the ini file and the marker."""
    return Option(name, default=False, action="store_true", check=settings.check_flag, **fields)


def _msprobe_rule(value: Any, where: str) -> bool:
    # the marker says msprobe_rule=False where the command line says --msprobe-no-msprobe-rule
    return not settings.check_flag(value, where)


# ------------------------------------------------------------------------------------------------ the table
# a table, laid out by hand: one entry per option, its spellings first
# fmt: off
BASELINE = Option(
    "baseline", flag="--msprobe-baseline", ini="msprobe_baseline",
    metavar="DIR", folder=True, check=settings.check_given,
    help="folder of per-test baseline dumps; turns on dumping and comparing",
)
REGEN = _switch(
    "regen_baseline", flag="--msprobe-regen-baseline", ini="msprobe_regen_baseline",
    help="write each msprobe test's dump as its baseline instead of comparing",
)
OUTPUT = Option(
    "output", flag="--msprobe-output", ini="msprobe_output",
    default="msprobe-output", metavar="DIR", folder=True, check=settings.check_given,
    help="folder for this run's dumps and reports",
)
DEVICE = Option(
    "device", flag="--msprobe-device", ini="msprobe_device",
    default="auto", metavar="DEVICE", check=settings.check_device, blank_cli="refused",
    help="auto, cpu, cuda or npu; auto picks npu, then cuda, then cpu", ini_help="auto, cpu, cuda or npu",
)
TASK = Option(
    "task", ini="msprobe_task", marker="task",
    default="statistics", check=_choice(TASKS, "task"), check_names_it=True,
    ini_help=f"default task of msprobe tests: {', '.join(TASKS)}",
)
LEVEL = Option(
    "level", ini="msprobe_level", marker="level",
    default="L1", check=_choice(LEVELS, "level"), check_names_it=True,
    ini_help=f"default level of msprobe tests: {', '.join(LEVELS)}",
)
STEPS = Option(
    "steps", ini="msprobe_steps", marker="steps",
    default=(0, 1), check=settings.check_steps, check_names_it=True,
    ini_help="default dumped steps of msprobe tests, e.g. '0 1'",
)
SEED = Option(
    "seed", ini="msprobe_seed", marker="seed",
    default=1234, check=settings.check_seed, check_names_it=True,
    ini_help="default seed of msprobe tests",
)
MAX_DUMP_SIZE = Option(
    "max_dump_size", flag="--msprobe-max-dump-size", ini="msprobe_max_dump_size", marker="max_dump_size",
    metavar="SIZE", check=_size, blank_cli="unset",
    help="stop a test's tensor dump before its files take more than SIZE, e.g. 500MB or 2GiB",
    ini_help="most a test's tensor files may take, e.g. 500MB or 2GiB",
)
KEEP_DUMPS = _switch(
    "keep_dumps", flag="--msprobe-keep-dumps", ini="msprobe_keep_dumps",
    help="keep the dumps of passing tests and regenerated baselines; by default only those of tests that "
    "fail or error stay in --msprobe-output",
)
SELF_CHECK = _switch(
    "self_check", flag="--msprobe-self-check", ini="msprobe_self_check", marker="self_check",
    help="replay each API call on the CPU in float64 as the steps run and fail on a call whose own error is "
    "out of line; without a baseline the steps are dumped for it",
)
CHECKLIST_ENV = Option(
    "checklist_env", ini="msprobe_checklist_env", marker="checklist_env",
    default=(), check=settings.check_env_names, ini_type="linelist",
    ini_help="environment variables the checklist records beside its own list, one per line",
)
WORLD_SIZE = Option(
    "world_size", marker="world_size", default=1, check=settings.check_world_size, check_names_it=True,
)
BACKEND = Option("backend", marker="backend", check=settings.check_backend, check_names_it=True)
RANK_TIMEOUT = Option(
    "rank_timeout", flag="--msprobe-rank-timeout", ini="msprobe_rank_timeout", marker="rank_timeout",
    default=DEFAULT_RANK_TIMEOUT, metavar="SECONDS", check=settings.check_seconds,
    help="stop the rank processes of a multi-rank test (marker world_size=N) that have not finished after "
    f"SECONDS, counted once they have all joined the process group (their start-up may take {RANK_STARTUP:g} s "
    "more), and fail the test",
    ini_help="seconds the rank processes of a multi-rank test may take",
)
TREND_STEPS = Option(
    "trend_steps", flag="--msprobe-trend-steps", ini="msprobe_trend_steps", marker="trend_steps", metavar="N",
    check=settings.check_trend_steps, check_names_it=True, ini_help="trend steps of msprobe tests",
    help="compare the loss (msprobe.loss) and gradient norms of the first N steps with the baseline's",
)
TREND_RTOL = Option(
    "trend_rtol", flag="--msprobe-trend-rtol", ini="msprobe_trend_rtol", marker="trend_rtol", metavar="FLOAT",
    check=settings.check_trend_rtol, check_names_it=True,
    help="relative tolerance of the trend (default: the training dtype's, float32 1e-4)",
)
REPORT_ONLY = _switch(
    "report_only", flag="--msprobe-report-only", ini="msprobe_report_only", marker="report_only",
    help="record each msprobe test's precision verdict (a breach, a missing baseline) in the reports without "
    "failing the test; usage errors and unusable baselines still do",
)
ALLOW_TF32 = _switch(
    "allow_tf32", flag="--msprobe-allow-tf32", ini="msprobe_allow_tf32", marker="allow_tf32",
    help="leave TF32 and HF32 as the device and the test set them, instead of float32 math in float32",
)
# a rank process's part of its test, given by the plugin
RANK_SPEC = Option("rank_spec", flag="--msprobe-rank-spec", help=argparse.SUPPRESS)
THRESHOLD_OPTIONS = (
    _shared(
        "rtol", metavar="FLOAT", type=settings.parse_nonnegative,
        help="error tolerance (scaled error) for every floating dtype, replacing the dtype table "
        "(float32 default 1e-4); the warning level follows at a tenth unless set",
    ),
    _shared(
        "warn_rtol", metavar="FLOAT", type=settings.parse_nonnegative,
        help="warning level (scaled error) for every floating dtype",
    ),
    _shared(
        "atol", metavar="FLOAT", type=settings.parse_nonnegative,
        help="absolute differences at or below this never count (float32 default 1e-9)",
    ),
    _shared(
        "dtype_rtol", metavar="DTYPE=FLOAT", action="append", type=settings.parse_dtype_pair, ini_type="linelist",
        help="error tolerance of one dtype, e.g. bfloat16=0.03 (repeatable)",
        ini_help="lines of DTYPE=FLOAT: error tolerance of one dtype",
    ),
    _shared(
        "api_rtol", metavar="PATTERN=FLOAT", action="append", type=settings.parse_pair, ini_type="linelist",
        help="error tolerance of the APIs (or rows) matching a glob, e.g. 'Functional.softmax.*=1e-3' "
        "(repeatable)",
        ini_help="lines of GLOB=FLOAT: error tolerance of matching APIs or rows",
    ),
    _shared(
        "skip_api", metavar="PATTERN", action="append", ini_type="linelist",
        help="report the APIs (or rows) matching a glob but never fail on them (repeatable)",
        ini_help="lines of GLOB: report matching APIs but never fail on them",
    ),
    _shared(
        "amplification", metavar="FACTOR", type=settings.parse_amplification,
        help="when errors already flow in, the first divergence is the first API whose output error is "
        "FACTOR times its input error (default 10)",
        ini_help="output/input error ratio that places the first divergence when errors flow in",
    ),
    _shared(
        "max_unmatched", metavar="SHARE", type=settings.parse_share_option,
        help="fail when more than SHARE of the baseline's rows in a dump pair (step, rank) found no partner "
        "in the target, e.g. 5%% or 0.05 (default 5%%; 0: every baseline row must pair)",
        ini_help="most of a dump pair's baseline rows that may find no partner in the target (5% or 0.05)",
    ),
    _shared(
        "thresholds", metavar="FILE", ini_path=True,
        help="JSON file of thresholds ({'dtypes': {...}, 'apis': [...], 'amplification': ..., "
        "'msprobe_rule': ..., 'max_unmatched': ...}); the options above override it",
        ini_help="JSON file of thresholds",
    ),
    _shared(
        "no_msprobe_rule", ini=None, marker="msprobe_rule", marker_value="False",
        default=False, action="store_true", check=_msprobe_rule,
        help="tensor mode: do not also apply msprobe 8.3.3's cosine / MaxAbsErr accuracy rule",
    ),
)
OPTIONS: tuple[Option, ...] = (
    BASELINE, REGEN, OUTPUT, DEVICE, TASK, LEVEL, STEPS, SEED, MAX_DUMP_SIZE, KEEP_DUMPS, SELF_CHECK, CHECKLIST_ENV,
    WORLD_SIZE, BACKEND, RANK_TIMEOUT, TREND_STEPS, TREND_RTOL, REPORT_ONLY, ALLOW_TF32, RANK_SPEC, *THRESHOLD_OPTIONS,
)
# fmt: on
BY_NAME = {opt.name: opt for opt in OPTIONS}
MARKER_KEYS = frozenset(opt.marker for opt in OPTIONS if opt.marker is not None)
MARKER_HELP = (
    f"msprobe(task={TASK.default!r}, level={LEVEL.default!r}, steps={list(STEPS.default)}, "
    f"seed={SEED.default}, rtol=..., api_rtol={{...}}, ...): dump this test's training steps and compare "
    "them with the test's baseline (see the msprobe fixture)"
)


def parse_threshold_value(name: str, value: Any, where: str) -> Any:
    """Parse a threshold setting given as text or as a Python value (an ini line, a marker keyword).

    ``name`` is an option destination without prefix (``rtol``, ``dtype_rtol``...). List options take a list
    of ``NAME=NUMBER`` strings or, for the two ``*_rtol`` ones, a mapping ``{NAME: NUMBER}``. The result has
    the shape argparse would give; a bad value raises ConfigError naming ``where`` and quoting the value.
    """
    opt = BY_NAME.get(name)
    opt = opt if opt is not None and opt.shared else None  # the threshold settings only
    parse = (opt.type if opt is not None else None) or str
    try:
        if opt is not None and opt.action is None:
            if isinstance(value, bool) or not isinstance(value, (str, int, float, os.PathLike)):
                raise argparse.ArgumentTypeError(f"expected a number or text, got {value!r}")
            return parse(os.fspath(value) if isinstance(value, os.PathLike) else str(value))
        if opt is not None and opt.action == "append":
            if isinstance(value, Mapping) and opt.type is not None:  # NAME=NUMBER items
                items = [f"{k}={v}" for k, v in value.items()]
            elif isinstance(value, str):
                items = [line.strip() for line in value.splitlines() if line.strip()]
            elif isinstance(value, (list, tuple)):
                items = [str(v) for v in value]
            else:
                raise argparse.ArgumentTypeError(f"expected a list, got {value!r}")
            return [parse(item) for item in items]
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where}: unknown threshold setting {name!r}")


# -------------------------------------------------------------------------------------- pytest and argparse
def _argparse_kwargs(opt: Option, dest: str, elsewhere: bool = True) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dest": dest, "default": opt.default if opt.action == "store_true" else None}
    for key in ("action", "type", "metavar"):
        if getattr(opt, key) is not None:
            kwargs[key] = getattr(opt, key)
    kwargs["help"] = opt.flag_help(elsewhere)
    return kwargs


def add_pytest_options(parser: Any) -> None:
    """Declare every flag on pytest's ``msprobe`` option group and every ini key, on pytest's ``parser``."""
    group = parser.getgroup("msprobe", "precision regression testing against msprobe-format baselines")
    for opt in OPTIONS:
        if opt.flag is not None:
            group.addoption(opt.flag, **_argparse_kwargs(opt, opt.dest))
    for opt in OPTIONS:
        if opt.ini is not None:  # a folder's default is None: set to nothing, it is refused, not "unset"
            extra = {"default": None} if opt.folder else {}
            parser.addini(opt.ini, opt.ini_text(), type=opt.ini_type, **extra)


def add_threshold_options(addoption: Callable[..., Any], prefix: str = "") -> None:
    """Declare the threshold options on argparse's ``add_argument`` or pytest's ``group.addoption``.

    ``prefix`` namespaces them (``"msprobe-"`` gives the plugin's ``--msprobe-rtol``); the destinations are
    the option names with dashes as underscores, read back by :func:`thresholds_from_options` with the same
    prefix.
    """
    for opt in THRESHOLD_OPTIONS:
        flag = "--" + prefix + opt.name.replace("_", "-")
        addoption(flag, **_argparse_kwargs(opt, prefix.replace("-", "_") + opt.name, elsewhere=bool(prefix)))


def getter(options: Any) -> Getter:
    """Values by destination from a getter, a pytest Config, a mapping or an argparse Namespace."""
    if callable(options):
        return options
    if hasattr(options, "getoption"):  # a pytest Config
        return lambda name: options.getoption(name, None)
    if isinstance(options, Mapping):
        return options.get
    return lambda name: getattr(options, name, None)


# ------------------------------------------------------------------------------------------------ layers
CLI, MARKER, INI = range(3)
Layers = Sequence[Mapping[str, tuple[Any, str]]]  # per layer: option name -> (value as given, where)


def _given(opt: Option, layer: int, value: Any) -> bool:
    if layer == CLI:  # argparse's default (None, or False for a switch) is "not given"
        blank = value == "" and opt.blank_cli == "unset"
        return not (value is None or value is False or (isinstance(value, list) and not value) or blank)
    if layer == INI and opt.folder:  # set to nothing is a value (refused as empty)
        return value is not None
    return value not in (None, "", [])


def _layers(
    options: Sequence[Option],
    cli: Callable[[Option], Any],
    marker: Mapping[str, Any],
    ini: Getter,
    test: str = "this test",
) -> Layers:
    """What the command line (``cli`` gives an option's value), the marker and the ini file give of
    ``options``, unchecked."""
    where_marker = f"@pytest.mark.msprobe on {test}"
    layers: tuple[dict[str, tuple[Any, str]], ...] = ({}, {}, {})
    for opt in options:
        if opt.flag is not None and _given(opt, CLI, value := cli(opt)):
            layers[CLI][opt.name] = value, opt.flag
        if opt.marker is not None and opt.marker in marker:
            where = where_marker if opt.check_names_it else f"{where_marker}: {opt.marker}"
            layers[MARKER][opt.name] = marker[opt.marker], where
        if opt.ini is not None and _given(opt, INI, value := ini(opt.ini)):
            layers[INI][opt.name] = value, f"ini {opt.ini}"
    return layers


def _read(opt: Option, layer: int, layers: Layers, ini_dir: Path) -> Any:
    """The value ``layer`` gives, checked (ConfigError quoting it and where it was given)."""
    value, where = layers[layer][opt.name]
    if layer == CLI and (opt.type is not None or opt.action == "store_true"):
        return value  # argparse parsed it
    if layer == CLI and opt.blank_cli == "refused":
        settings.check_given(value, where)
    if layer == INI and opt.ini_path:
        value = _path(value, ini_dir)
    if opt.check is not None:
        return opt.check(value, where)
    return parse_threshold_value(opt.name, value, where) if opt.shared else value


def _top(opt: Option, layers: Layers, ini_dir: Path) -> Any:
    """The value of the highest layer that gives ``opt``, else its default."""
    layer = next((layer for layer, given in enumerate(layers) if opt.name in given), None)
    return opt.default if layer is None else _read(opt, layer, layers, ini_dir)


def _path(value: Any, base: Path) -> Path:
    path = Path(os.path.expanduser(os.fspath(value)))
    return path if path.is_absolute() else base / path


RTOL, WARN_RTOL, ATOL, DTYPE_RTOL = THRESHOLD_OPTIONS[:4]


def _thresholds(layers: Layers, ini_dir: Path) -> Thresholds:
    """Thresholds from the layers (highest first) over the thresholds file and the built-in table."""
    # each setting's value from its highest layer, checked in the table's order
    values = {opt.name: _top(opt, layers, ini_dir) for opt in THRESHOLD_OPTIONS}
    base = load_thresholds_file(values["thresholds"]) if values["thresholds"] else Thresholds()
    dtypes = dict(base.dtypes)
    pairs: dict[int, list[tuple[str, float]]] = {}  # each layer's dtype_rtol, read once
    for dtype, tol in base.dtypes.items():  # all of its tolerance from the highest layer that says anything
        for layer, given in enumerate(layers):
            if DTYPE_RTOL.name in given and layer not in pairs:
                pairs[layer] = _read(DTYPE_RTOL, layer, layers, ini_dir)
            own = [value for name, value in pairs.get(layer, ()) if name == dtype]
            glob = dtype in FLOATING and any(opt.name in given for opt in (RTOL, WARN_RTOL, ATOL))
            if glob:
                rtol, warn, atol = (
                    _read(opt, layer, layers, ini_dir) if opt.name in given else None
                    for opt in (RTOL, WARN_RTOL, ATOL)
                )
                error = tol.error if rtol is None else rtol
                warning = (
                    warn if warn is not None else (warning_of(rtol) if rtol is not None else tol.warning)
                )
                tol = Tolerance(error, min(warning, error), tol.atol if atol is None else atol)
            for value in own:  # within its layer a dtype's own tolerance beats the global one
                tol = Tolerance(value, warning_of(value), tol.atol)
            if glob or own:
                dtypes[dtype] = tol
                break
    rules = list(base.apis)
    rules.extend(ApiRule(pattern, error=value) for pattern, value in values["api_rtol"] or ())
    rules.extend(ApiRule(pattern, skip=True) for pattern in values["skip_api"] or ())
    amplification = values["amplification"] if values["amplification"] is not None else base.amplification
    msprobe_rule = base.msprobe_rule and not values["no_msprobe_rule"]
    max_unmatched = values["max_unmatched"] if values["max_unmatched"] is not None else base.max_unmatched
    return Thresholds(dtypes, tuple(rules), amplification, msprobe_rule, max_unmatched)


def thresholds_from_options(options: Any, prefix: str = "") -> Thresholds:
    """Thresholds from parsed options (argparse Namespace, pytest Config or a mapping of destinations)."""
    dest, get = prefix.replace("-", "_"), getter(options)
    layers = _layers(THRESHOLD_OPTIONS, lambda opt: get(dest + opt.name), {}, lambda _: None)
    return _thresholds(layers, Path())


# ------------------------------------------------------------------------------------------------ settings
def resolve_session(cli: Any, ini: Any, invocation_dir: Path, ini_dir: Path) -> SessionSettings:
    """Session settings; command-line paths are relative to where pytest was started, ini paths to the ini file.

    ``cli`` gives command-line values by destination and ``ini`` ini values by key (see :func:`getter`).
    """
    session = (BASELINE, REGEN, OUTPUT, DEVICE, MAX_DUMP_SIZE, KEEP_DUMPS, RANK_TIMEOUT, SELF_CHECK, REPORT_ONLY, ALLOW_TF32)  # fmt: skip
    get = getter(cli)
    layers = _layers(session, lambda opt: get(opt.dest), {}, getter(ini))

    def folder(opt: Option) -> tuple[Path | None, str]:
        for layer, base in ((CLI, invocation_dir), (INI, ini_dir)):
            if opt.name in layers[layer]:
                return _path(_read(opt, layer, layers, ini_dir), base), layers[layer][opt.name][1]
        return None, ""

    baseline, _ = folder(BASELINE)
    regen = bool(_top(REGEN, layers, ini_dir))
    output, output_from = folder(OUTPUT)
    if output is None:
        output, output_from = _path(OUTPUT.default, ini_dir), f"the output folder (default {OUTPUT.default})"
    device = str(_top(DEVICE, layers, ini_dir))
    if regen and baseline is None:
        raise ConfigError(f"{REGEN.flag} needs {BASELINE.flag}=DIR (or ini {BASELINE.ini})")
    if baseline is not None and os.path.exists(baseline) and not os.path.isdir(baseline):
        raise ConfigError(f"the baseline folder {baseline} is a file, not a folder")
    if baseline is not None:
        check_apart(output, baseline, output_from, OUTPUT.flag)
    keep_dumps, report_only = (bool(_top(opt, layers, ini_dir)) for opt in (KEEP_DUMPS, REPORT_ONLY))
    # resolved per test (a marker sits between them), checked here so that a bad value stops the run at once
    for opt in (MAX_DUMP_SIZE, RANK_TIMEOUT, SELF_CHECK, ALLOW_TF32):
        for layer in (CLI, INI):
            if opt.name in layers[layer]:
                _read(opt, layer, layers, ini_dir)
    return SessionSettings(baseline, regen, output, device, keep_dumps, report_only)


def _did_you_mean(key: str) -> str:
    """A misspelt marker keyword with the known one it is closest to: ``step (did you mean steps?)``."""
    close = difflib.get_close_matches(key, sorted(MARKER_KEYS), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


def resolve_test(
    cli: Any, marker: Mapping[str, Any], ini: Any, ini_dir: Path, test: str = "this test"
) -> TestSettings:
    """Per-test settings from the marker's keywords, with ini defaults below and the command line above."""
    unknown = sorted(set(marker) - MARKER_KEYS)
    if unknown:
        raise ConfigError(
            f"@pytest.mark.msprobe on {test}: unknown keyword(s) {', '.join(map(_did_you_mean, unknown))} "
            f"(known: {', '.join(sorted(MARKER_KEYS))})"
        )
    per_test = tuple(opt for opt in OPTIONS if opt.marker is not None and not opt.shared)
    get = getter(cli)
    layers = _layers((*per_test, *THRESHOLD_OPTIONS), lambda opt: get(opt.dest), marker, getter(ini), test)
    values = {opt.name: _top(opt, layers, ini_dir) for opt in per_test}  # (each named as its setting)
    return TestSettings(thresholds=_thresholds(layers, ini_dir), **values)
