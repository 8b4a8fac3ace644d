"""Arguments and outputs in msprobe's JSON shapes: tensors, scalars, containers and torch/numpy objects."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.recorder import Recorder
from pytest_msprobe.dump.stats import StatEngine


def _analyze(value: Any) -> Any:
    engine = StatEngine()
    recorder = Recorder(DumpConfig(dump_path=Path("unused")), engine)
    out = recorder.analyze(value, None, False)
    engine.flush()
    return out


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (1, {"type": "int", "value": 1}),
        (0.1, {"type": "float", "value": 0.1}),
        (True, {"type": "bool", "value": True}),
        ("mean", {"type": "str", "value": "mean"}),
        ((1, 1), [{"type": "int", "value": 1}, {"type": "int", "value": 1}]),
        ([None, [2]], [None, [{"type": "int", "value": 2}]]),
        ({"k": 3}, {"k": {"type": "int", "value": 3}}),
        (torch.float16, {"type": "torch.dtype", "value": "torch.float16"}),
        (torch.device("cpu"), {"type": "torch.device", "value": "cpu"}),
        (torch.preserve_format, {"type": "torch.memory_format", "format": "preserve_format"}),
        (torch.channels_last, {"type": "torch.memory_format", "format": "channels_last"}),
        (torch.Size([2, 3]), {"type": "torch.Size", "value": [2, 3]}),
        (slice(1, None, 2), {"type": "slice", "value": [1, None, 2]}),
        (Ellipsis, {"type": "ellipsis", "value": "..."}),
        (np.float32(1.5), {"type": "float32", "value": 1.5}),
        (np.int64(7), {"type": "int64", "value": 7}),
        (object(), None),
    ],
)
def test_non_tensor_values(value: Any, expected: Any) -> None:
    assert _analyze(value) == expected


def test_slice_with_tensor_bounds_becomes_ints() -> None:
    assert _analyze(slice(torch.tensor(2), torch.tensor(5))) == {"type": "slice", "value": [2, 5, None]}


def test_namedtuple_becomes_a_dict_of_fields() -> None:
    pair = namedtuple("pair", ["a", "b"])
    assert _analyze(pair(1, "x")) == {"a": {"type": "int", "value": 1}, "b": {"type": "str", "value": "x"}}


def test_dataclass_fields_are_kept() -> None:
    @dataclass
    class Opts:
        scale: float
        sizes: tuple[int, ...]

    assert _analyze(Opts(2.0, (1, 2))) == {
        "scale": {"type": "float", "value": 2.0},
        "sizes": [{"type": "int", "value": 1}, {"type": "int", "value": 2}],
    }


def test_ndarray_statistics() -> None:
    out = _analyze(np.array([[1.0, -3.0], [2.0, 0.0]], dtype=np.float32))
    assert out["type"] == "numpy.ndarray"
    assert out["dtype"] == "float32" and out["shape"] == [2, 2]
    assert (out["Max"], out["Min"], out["Mean"]) == (2.0, -3.0, 0.0)
    assert out["Norm"] == pytest.approx(np.sqrt(14.0))


def test_tensor_nested_in_containers() -> None:
    out = _analyze([torch.ones(2), (torch.zeros(1), 3)])
    assert out[0]["Max"] == 1.0 and out[0]["shape"] == [2]
    assert out[1][0]["type"] == "torch.Tensor" and out[1][0]["Max"] == 0.0
    assert out[1][1] == {"type": "int", "value": 3}
