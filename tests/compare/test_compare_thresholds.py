"""Thresholds are data: the dtype table, API rules, the shared options and the JSON file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.options import add_threshold_options, thresholds_from_options
from pytest_msprobe.thresholds import (
    DEFAULT_DTYPE_TOLERANCES,
    ApiRule,
    Thresholds,
    Tolerance,
    load_thresholds_file,
    normalize_dtype,
    thresholds_from_dict,
)


def test_defaults_scale_with_the_precision_of_the_dtype() -> None:
    t = Thresholds()
    order = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn"]
    errors = [t.for_dtype(f"torch.{name}").error for name in order]
    assert errors == sorted(errors) and len(set(errors)) == len(errors)
    assert t.for_dtype("torch.float32") == Tolerance(1e-4, 1e-5, 1e-9)
    assert t.for_dtype("torch.int64") == Tolerance(0.0, 0.0, 0.0)
    assert t.for_dtype("something.new") == t.for_dtype("torch.float32")
    assert t.amplification == 10 and t.msprobe_rule


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("torch.float32", "float32"),
        ("fp16", "float16"),
        ("bf16", "bfloat16"),
        ("Half", "float16"),
        ("double", "float64"),
    ],
)
def test_dtype_aliases(name: str, canonical: str) -> None:
    assert normalize_dtype(name) == canonical


def test_a_row_gets_the_tolerance_of_its_baselines_dtype() -> None:
    tol, skip = Thresholds().tolerance("torch.bfloat16", "A.b.0.forward", "A.b.0.forward.output.0")
    assert tol == DEFAULT_DTYPE_TOLERANCES["bfloat16"] and not skip


def test_integer_tensors_are_exact_by_value_and_float32_like_by_statistics() -> None:
    t = Thresholds()
    assert t.tolerance("torch.int64", "a", "a")[0].error == 0
    assert t.tolerance("torch.int64", "a", "a", statistics=True)[0] == t.for_dtype("float32")


def test_api_rules_match_api_or_row_and_the_last_match_wins() -> None:
    t = Thresholds(
        apis=(
            ApiRule("Functional.softmax.*", error=1e-3),
            ApiRule("*.backward.output.*", error=5e-3, warning=1e-3),
            ApiRule("Functional.dropout.*", skip=True),
        )
    )
    tol, skip = t.tolerance(
        "torch.float32", "Functional.softmax.0.forward", "Functional.softmax.0.forward.output.0"
    )
    assert (tol.error, tol.warning, skip) == (1e-3, 1e-4, False)
    tol, _ = t.tolerance(
        "torch.float32", "Functional.softmax.0.backward", "Functional.softmax.0.backward.output.0"
    )
    assert (tol.error, tol.warning) == (5e-3, 1e-3)
    tol, _ = t.tolerance("torch.float32", "Functional.relu.0.forward", "Functional.relu.0.forward.output.0")
    assert tol.error == 1e-4
    assert t.tolerance("torch.float32", "Functional.dropout.3.forward", "x")[1] is True


def _parse(argv: list[str], prefix: str = "") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_threshold_options(parser.add_argument, prefix)
    return parser.parse_args(argv)


def test_options_on_argparse() -> None:
    ns = _parse(
        [
            "--rtol",
            "1e-3",
            "--dtype-rtol",
            "bf16=0.05",
            "--api-rtol",
            "Functional.softmax.*=0.01",
            "--skip-api",
            "Functional.dropout.*",
            "--amplification",
            "4",
            "--no-msprobe-rule",
        ]
    )
    t = thresholds_from_options(ns)
    assert t.for_dtype("float32") == Tolerance(1e-3, 1e-4, 1e-9)
    assert t.for_dtype("float16").error == 1e-3  # --rtol replaces every floating dtype...
    assert t.for_dtype("int64").error == 0  # ...but not the exact ones
    assert t.for_dtype("bfloat16").error == 0.05  # and --dtype-rtol comes after it
    assert t.apis == (ApiRule("Functional.softmax.*", error=0.01), ApiRule("Functional.dropout.*", skip=True))
    assert t.amplification == 4 and t.msprobe_rule is False
    assert thresholds_from_options(_parse([])) == Thresholds()


def test_options_with_a_prefix_as_the_pytest_plugin_declares_them() -> None:
    """pytest's group.addoption takes argparse's arguments; the plugin uses the 'msprobe-' prefix."""
    ns = _parse(
        ["--msprobe-rtol", "2e-4", "--msprobe-warn-rtol", "1e-6", "--msprobe-atol", "1e-9"], "msprobe-"
    )
    assert ns.msprobe_rtol == 2e-4
    t = thresholds_from_options(ns, "msprobe-")
    assert t.for_dtype("float32") == Tolerance(2e-4, 1e-6, 1e-9)

    class FakeConfig:  # what the plugin will pass: a pytest Config
        def getoption(self, name: str, default: object = None) -> object:
            return vars(ns).get(name, default)

    assert thresholds_from_options(FakeConfig(), "msprobe-") == t
    assert thresholds_from_options(vars(ns), "msprobe-") == t


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rtol", "abc"], "expected a number, got 'abc'"),
        (["--rtol", "-1"], "expected a number >= 0, got '-1'"),
        (["--dtype-rtol", "bf16"], "expected NAME=NUMBER, got 'bf16'"),
        (["--dtype-rtol", "float99=0.1"], "unknown dtype 'float99'"),
        (["--api-rtol", "x=y"], "expected a number, got 'y'"),
        (["--amplification", "0.5"], "expected a number >= 1, got '0.5'"),
    ],
)
def test_bad_option_values_are_quoted(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_thresholds_file_round_trips(tmp_path: Path) -> None:
    t = Thresholds(
        dtypes={**DEFAULT_DTYPE_TOLERANCES, "float32": Tolerance(2e-4, 3e-5, 1e-10)},
        apis=(ApiRule("*.softmax.*", error=1e-2), ApiRule("*dropout*", skip=True)),
        amplification=5.0,
        msprobe_rule=False,
    )
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_dict()))
    assert load_thresholds_file(path) == t
    # and the options override the file
    ns = _parse(["--thresholds", str(path), "--amplification", "20"])
    again = thresholds_from_options(ns)
    assert again.amplification == 20 and again.for_dtype("float32") == Tolerance(2e-4, 3e-5, 1e-10)


def test_a_partial_dtype_entry_keeps_the_rest() -> None:
    t = thresholds_from_dict({"dtypes": {"bf16": {"error": 0.05}}})
    assert t.for_dtype("bfloat16") == Tolerance(0.05, 0.005, DEFAULT_DTYPE_TOLERANCES["bfloat16"].atol)
    assert t.for_dtype("float32") == DEFAULT_DTYPE_TOLERANCES["float32"]


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], "expected a JSON object"),
        ({"dtype": {}}, "unknown key(s) ['dtype']"),
        ({"dtypes": {"float32": {"eror": 1}}}, "dtypes.float32 must be an object"),
        ({"dtypes": {"float32": {"error": "big"}}}, "dtypes.float32.error must be a number, got 'big'"),
        ({"apis": [{"error": 1}]}, "apis[0] must be an object with a 'pattern'"),
        ({"apis": [{"pattern": "x", "skip": True, "why": 1}]}, "apis[0] has unknown key(s)"),
        ({"amplification": 0.1}, "amplification must be >= 1"),
        ({"msprobe_rule": "yes"}, "msprobe_rule must be true or false"),
    ],
)
def test_bad_thresholds_files_name_the_file_and_the_value(tmp_path: Path, doc: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_thresholds_file(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_unreadable_thresholds_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_thresholds_file(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_thresholds_file(tmp_path / "x.json")


def test_options_declared_through_pytest(tmp_path: Path) -> None:
    """The plugin declares the options on its pytest group; they read back from the Config."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "from pytest_msprobe.options import thresholds_from_options\n"
        "def pytest_configure(config):\n"
        "    config.thresholds = thresholds_from_options(config, 'msprobe-')\n"
    )
    (tmp_path / "test_x.py").write_text(
        "def test_x(pytestconfig):\n"
        "    t = pytestconfig.thresholds\n"
        "    assert t.for_dtype('float32').error == 2e-4 and t.apis[0].pattern == 'Functional.softmax.*'\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        str(tmp_path),
    ]
    ok = subprocess.run(
        [*args, "--msprobe-rtol", "2e-4", "--msprobe-api-rtol", "Functional.softmax.*=1e-3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [*args, "--msprobe-rtol", "x"], capture_output=True, text=True, env=env, cwd=tmp_path, check=False
    )
    assert bad.returncode == 4 and "expected a number, got 'x'" in bad.stderr
