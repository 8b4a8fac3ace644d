"""Settings from arguments and msprobe's config.json, validated with errors that name the key and value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_msprobe.dump.config import build_config
from pytest_msprobe.errors import ConfigError

MSPROBE_CONFIG = (
    Path(__file__).resolve().parents[1] / "data" / "msprobe" / "msprobe-8.3.3" / "configs" / "md5_L1.json"
)


def _write(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_msprobe_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = build_config(MSPROBE_CONFIG)
    assert config.task == "statistics" and config.summary_mode == "md5" and config.md5
    assert config.level == "L1" and config.steps == frozenset({0, 1}) and config.ranks is None
    assert config.dump_path == tmp_path / "dump_path"
    assert config.data_mode == frozenset({"forward", "backward", "input", "output"})
    assert config.scope == () and config.api_list == ()


def test_explicit_arguments_override_the_file(tmp_path: Path) -> None:
    config = build_config(MSPROBE_CONFIG, task="tensor", dump_path=tmp_path / "x", step=[3], level="mix")
    assert (config.task, config.summary_mode, config.level) == ("tensor", "statistics", "mix")
    assert config.steps == frozenset({3}) and config.dump_path == tmp_path / "x"


def test_task_section_filters(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "task": "tensor",
            "dump_path": str(tmp_path),
            "rank": [0, "2-3"],
            "tensor": {
                "scope": ["A.0", "B.1"],
                "list": ["relu"],
                "data_mode": ["backward"],
                "backward_input": "",
            },
            "statistics": {"summary_mode": "md5"},  # another task's section: not used
            "seed": 1234,
        },
    )
    config = build_config(path)
    assert config.task == "tensor" and not config.md5
    assert config.ranks == frozenset({0, 2, 3})
    assert config.scope == ("A.0", "B.1") and config.api_list == ("relu",)
    assert config.data_mode == frozenset({"backward", "input", "output"})


def test_any_path_is_accepted(tmp_path: Path) -> None:
    odd = tmp_path / "dumps with spaces" / "ünïcode;$(x)"
    assert build_config(dump_path=odd).dump_path == odd


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "free_benchmark"}, "task='free_benchmark'"),
        ({"task": "overflow_check", "overflow_nums": 0}, "overflow_nums=0"),
        ({"level": "L2"}, "level='L2'"),
        ({"step": [-1]}, "step=[-1]"),
        ({"step": ["a-b"]}, "'a-b' is neither an integer nor a range"),
        ({"step": ["5-2"]}, "bad range '5-2'"),
        ({"rank": [True]}, "True is not an integer"),
        ({"data_mode": ["all", "forward"]}, "'all' cannot be combined"),
        ({"data_mode": ["sideways"]}, "data_mode='sideways'"),
        ({"scope": ["a", "b", "c"]}, "at most two names"),
        ({"api_list": "relu"}, "list='relu'"),
        ({"task": "tensor", "summary_mode": "md5"}, "only valid with task 'statistics'"),
        ({"summary_mode": "sha1"}, "summary_mode='sha1'"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("dump_path", tmp_path)
    with pytest.raises(ConfigError) as info:
        build_config(**kwargs)
    assert message in str(info.value)


def test_bad_values_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {"task": "statistics", "dump_path": "d", "level": "L9"})
    with pytest.raises(ConfigError, match=r"level='L9' in .*config\.json"):
        build_config(path)


def test_missing_dump_path_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dump_path is not set"):
        build_config()
    with pytest.raises(ConfigError, match="config file not found"):
        build_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"invalid JSON at line 1"):
        build_config(_write(tmp_path, "{task: statistics}"))
    with pytest.raises(ConfigError, match="expected a JSON object at the top level"):
        build_config(_write(tmp_path, "[1, 2]"))


def test_unknown_keys_warn(tmp_path: Path) -> None:
    path = _write(tmp_path, {"dump_path": "d", "dump_evrything": True})
    with pytest.warns(UserWarning, match="ignoring unknown key 'dump_evrything'"):
        build_config(path)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"task": "statistics", "statistics": {"summary_mod": "md5"}},
            "section 'statistics': ignoring unknown key 'summary_mod' (did you mean 'summary_mode'?)",
        ),
        (
            {"task": "tensor", "tensor": {"scop": []}},
            "section 'tensor': ignoring unknown key 'scop' (did you mean 'scope'?)",
        ),
        (  # a section of another task is read for typos too
            {"task": "statistics", "overflow_check": {"overflow_num": 1}},
            "section 'overflow_check': ignoring unknown key 'overflow_num' (did you mean 'overflow_nums'?)",
        ),
        (
            {"task": "statistics", "grad_probe": {"grad_levle": "L1"}},
            "section 'grad_probe': ignoring unknown key 'grad_levle' (did you mean 'grad_level'?)",
        ),
        ({"levle": "L1"}, ": ignoring unknown key 'levle' (did you mean 'level'?)"),
        ({"statistics": {"zzz": 1}}, "section 'statistics': ignoring unknown key 'zzz'"),
    ],
)
def test_unknown_keys_of_any_section_warn_with_the_nearest_known_key(
    tmp_path: Path, doc: dict[str, Any], message: str
) -> None:
    from pytest_msprobe import PrecisionDebugger

    path = _write(tmp_path, {"dump_path": str(tmp_path / "d"), **doc})
    with pytest.warns(UserWarning) as caught:
        PrecisionDebugger(config_path=path)
    texts = [str(w.message) for w in caught]
    assert texts == [f"{path}{message}" if message.startswith(":") else f"{path}: {message}"]
    assert caught[0].filename == __file__, "the warning points at the PrecisionDebugger(...) line"


def test_msprobe_config_files_raise_no_warning(tmp_path: Path) -> None:
    import warnings

    for version in ("msprobe-8.3.3", "msprobe-26.2.0"):
        config = Path(__file__).parents[1] / "data" / "msprobe" / version / "configs" / "md5_L1.json"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_config(config, dump_path=str(tmp_path))
    full = {  # every key msprobe's own examples show
        "task": "statistics",
        "dump_path": "d",
        "rank": [],
        "step": [],
        "level": "L1",
        "async_dump": False,
        "extra_info": True,
        "dump_enable": True,
        "precision": "low",
        "statistics": {
            "scope": [],
            "list": [],
            "tensor_list": [],
            "data_mode": ["all"],
            "summary_mode": "statistics",
        },
        "tensor": {
            "scope": [],
            "list": [],
            "data_mode": ["all"],
            "bench_path": "b",
            "summary_mode": "md5",
            "diff_nums": 5,
        },
        "acc_check": {"white_list": [], "black_list": [], "error_data_path": "./"},
        "overflow_check": {"overflow_nums": 1, "check_mode": "all"},
        "free_benchmark": {
            "fuzz_device": "npu",
            "pert_mode": "improve_precision",
            "handler_type": "check",
            "fuzz_level": "L1",
            "fuzz_stage": "forward",
            "if_preheat": False,
            "preheat_step": 15,
            "max_sample": 20,
        },
        "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(_write(tmp_path, full))
