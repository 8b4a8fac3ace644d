"""The table of options: what is generated from it, and the one precedence rule of the threshold settings."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.options import (
    MARKER_KEYS,
    OPTIONS,
    THRESHOLD_OPTIONS,
    add_pytest_options,
    add_threshold_options,
    resolve_test,
)
from pytest_msprobe.thresholds import DEFAULT_DTYPE_TOLERANCES, Tolerance

F16 = DEFAULT_DTYPE_TOLERANCES["float16"]


def _tolerances(
    tmp_path: Path, cli: dict[str, Any], marker: dict[str, Any], ini: dict[str, Any] | None = None
) -> dict[str, Tolerance]:
    ini = ini or {}
    settings = resolve_test(cli.get, marker, lambda key: ini.get(key, ""), tmp_path)
    return {name: settings.thresholds.for_dtype(name) for name in ("float32", "float16", "int64")}


def test_a_global_value_on_the_command_line_speaks_for_every_floating_dtype(tmp_path: Path) -> None:
    t = _tolerances(tmp_path, {"msprobe_rtol": 0.5}, {"dtype_rtol": {"float32": 1e-3}})
    assert t["float32"] == Tolerance(0.5, 0.05, 1e-9)
    assert t["float16"] == Tolerance(0.5, 0.05, F16.atol)
    assert t["int64"].error == 0  # a global value is for the floating dtypes only


def test_the_markers_dtype_rtol_alone_sets_its_dtype(tmp_path: Path) -> None:
    t = _tolerances(tmp_path, {}, {"dtype_rtol": {"float32": 1e-3}})
    assert t["float32"] == Tolerance(1e-3, 1e-4, 1e-9)
    assert t["float16"] == F16


def test_a_higher_layer_that_names_one_dtype_leaves_the_others_to_the_layers_below(tmp_path: Path) -> None:
    t = _tolerances(
        tmp_path, {"msprobe_dtype_rtol": [("float32", 1e-3)]}, {"rtol": 0.5}, {"msprobe_atol": "1"}
    )
    assert t["float32"] == Tolerance(1e-3, 1e-4, 1e-9)  # all of float32 from the command line: no ini atol
    assert t["float16"] == Tolerance(0.5, 0.05, F16.atol)  # the marker's global value, not the ini's atol


def test_within_one_layer_a_dtype_beats_the_global_value(tmp_path: Path) -> None:
    t = _tolerances(tmp_path, {}, {"rtol": 0.5, "atol": 1e-9, "dtype_rtol": {"float32": 1e-3}})
    assert t["float32"] == Tolerance(1e-3, 1e-4, 1e-9)  # the layer's atol still holds
    assert t["float16"] == Tolerance(0.5, 0.05, 1e-9)


def test_a_dtype_no_higher_layer_speaks_of_falls_through_to_the_ini(tmp_path: Path) -> None:
    t = _tolerances(tmp_path, {"msprobe_rtol": 0.5}, {}, {"msprobe_dtype_rtol": ["int64=2", "float32=1e-3"]})
    assert t["int64"] == Tolerance(2.0, 0.2, 0.0)
    assert t["float32"].error == 0.5


def test_the_thresholds_file_sits_below_the_ini(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"dtypes": {"float32": {"error": 2e-3}, "float16": {"error": 0.1}}}))
    t = _tolerances(tmp_path, {}, {}, {"msprobe_thresholds": "t.json", "msprobe_dtype_rtol": ["float16=0.2"]})
    assert t["float32"].error == 2e-3 and t["float16"].error == 0.2


def test_scalars_and_lists_come_whole_from_the_highest_layer(tmp_path: Path) -> None:
    ini = {"msprobe_skip_api": ["ini.*"], "msprobe_amplification": "3", "msprobe_max_unmatched": "0.5"}
    settings = resolve_test(
        {"msprobe_amplification": 4.0}.get,
        {"skip_api": ["marker.*"], "amplification": 2},
        lambda key: ini.get(key, ""),
        tmp_path,
    )
    t = settings.thresholds
    assert [rule.pattern for rule in t.apis] == ["marker.*"]
    assert t.amplification == 4.0 and t.max_unmatched == 0.5


def test_a_value_that_a_higher_layer_overrides_is_never_checked(tmp_path: Path) -> None:
    t = _tolerances(tmp_path, {"msprobe_rtol": 0.5}, {}, {"msprobe_rtol": "abc"})
    assert t["float16"].error == 0.5
    with pytest.raises(ConfigError, match=r"ini msprobe_rtol: expected a number, got 'abc'"):
        _tolerances(tmp_path, {}, {}, {"msprobe_rtol": "abc"})


def test_every_spelling_is_the_tables_own_and_unique() -> None:
    for attr in ("name", "flag", "ini", "marker"):
        spelled = [getattr(opt, attr) for opt in OPTIONS if getattr(opt, attr) is not None]
        assert len(spelled) == len(set(spelled)), attr
    assert {opt.marker for opt in OPTIONS if opt.marker} == MARKER_KEYS
    assert all(opt.flag and opt.flag.startswith("--msprobe-") for opt in THRESHOLD_OPTIONS)


def test_the_offline_cli_and_the_plugin_declare_the_same_threshold_options() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.options: dict[str, dict[str, Any]] = {}
            self.inis: dict[str, dict[str, Any]] = {}

        def getgroup(self, name: str, description: str) -> Recorder:
            return self

        def addoption(self, flag: str, **kwargs: Any) -> None:
            self.options[flag] = kwargs

        def addini(self, name: str, help: str, **kwargs: Any) -> None:
            self.inis[name] = kwargs

    plugin, cli = Recorder(), Recorder()
    add_pytest_options(plugin)
    add_threshold_options(cli.addoption, "msprobe-")
    assert cli.options == {opt.flag: plugin.options[opt.flag] for opt in THRESHOLD_OPTIONS}
    assert plugin.inis["msprobe_baseline"] == {"type": "string", "default": None}  # set to nothing: refused
    assert plugin.inis["msprobe_skip_api"] == {"type": "linelist"}
    assert plugin.options["--msprobe-rank-spec"]["help"] == argparse.SUPPRESS


def test_the_options_module_imports_neither_pytest_nor_torch() -> None:
    code = (
        "import sys, pytest_msprobe.options; print(sorted({'pytest', '_pytest', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
