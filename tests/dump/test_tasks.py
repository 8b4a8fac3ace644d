"""Tasks tensor and md5: tensor files msprobe can read, CRCs taken before in-place changes."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe import PrecisionDebugger

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe"
MSPROBE_833 = DATA / "msprobe-8.3.3"


def _tensor_items(value: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    if isinstance(value, dict) and value.get("type") == "torch.Tensor":
        return [(path, value)]
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _tensor_items(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _tensor_items(v, f"{path}.{i}")
    return out


def _read(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step{step}" / "rank" / "dump.json").read_text())


def test_tensor_task_files_load_safely_and_match_the_statistics(tmp_path: Path, train: Any) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="tensor", level="L1", step=[0])
    train(debugger, steps=1, pass_model=False)
    dump = _read(tmp_path, 0)
    folder = tmp_path / "step0" / "rank" / "dump_tensor_data"
    assert dump["task"] == "tensor" and dump["dump_data_dir"] == str(folder)
    items = [item for entry in dump["data"].values() for _, item in _tensor_items(entry)]
    # and the optimizer's updates (optimizer.json), whose tensors are saved the same way
    sidecar = json.loads((tmp_path / "step0" / "rank" / "optimizer.json").read_text())
    items += [item for _, item in _tensor_items(sidecar["steps"])]
    assert len(items) > 200
    assert len({item["data_name"] for item in items}) == len(items)
    assert sorted(p.name for p in folder.iterdir()) == sorted(item["data_name"] for item in items)
    for item in items:
        t = torch.load(folder / item["data_name"], weights_only=True)
        assert type(t) is torch.Tensor and not t.requires_grad
        assert list(t.shape) == item["shape"] and str(t.dtype) == item["dtype"]
        if t.numel():
            assert t.max().item() == item["Max"] and t.min().item() == item["Min"]
            if t.is_floating_point() and t.dim():
                assert math.isclose(t.double().mean().item(), item["Mean"], rel_tol=1e-9, abs_tol=1e-12)


def test_tensor_task_names_and_contents_match_msprobe(tmp_path: Path, train: Any) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="tensor", level="L1", step=[0])
    train(debugger, steps=1, pass_model=False)
    ours = tmp_path / "step0" / "rank" / "dump_tensor_data"
    theirs = MSPROBE_833 / "dumps" / "bench" / "tensor_L1" / "step0" / "rank" / "dump_tensor_data"
    names = sorted(p.name for p in theirs.iterdir())
    assert len(names) == 226
    missing = [n for n in names if not (ours / n).exists()]
    assert not missing
    for name in names:
        a = torch.load(ours / name, weights_only=True)
        b = torch.load(theirs / name, weights_only=True)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # same computation on CPU (torch 2.14 here, 2.13 there, another processor's convolution kernels):
        # equal to float rounding (measured on an AMD processor: at most 1.2e-6 off, on values of order 1)
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5), name


def test_in_place_inputs_are_saved_as_they_were_before_the_call(tmp_path: Path) -> None:
    x = torch.zeros(3)
    with PrecisionDebugger(dump_path=tmp_path, task="tensor", level="L1") as debugger:
        debugger.start()
        x.add_(5)
        debugger.stop()
    folder = tmp_path / "step0" / "rank" / "dump_tensor_data"
    assert torch.equal(
        torch.load(folder / "Tensor.add_.0.forward.input.0.pt", weights_only=True), torch.zeros(3)
    )
    assert torch.equal(
        torch.load(folder / "Tensor.add_.0.forward.output.0.pt", weights_only=True), torch.full((3,), 5.0)
    )


def test_md5_is_stable_across_identical_runs_and_taken_before_in_place_ops(
    tmp_path: Path, train: Any
) -> None:
    runs = []
    for run in ("a", "b"):
        debugger = PrecisionDebugger(dump_path=tmp_path / run, task="md5", level="L1", step=[0, 1])
        train(debugger, steps=2, pass_model=False)
        runs.append([_read(tmp_path / run, step) for step in (0, 1)])
    first, second = runs
    for step in (0, 1):
        assert first[step]["task"] == "statistics"  # md5 is a summary mode of the statistics task
        crcs_a = {(n, p): i["md5"] for n, e in first[step]["data"].items() for p, i in _tensor_items(e)}
        crcs_b = {(n, p): i["md5"] for n, e in second[step]["data"].items() for p, i in _tensor_items(e)}
        assert len(crcs_a) > 200 and all(len(c) == 8 for c in crcs_a.values())
        assert crcs_a == crcs_b
    # BatchNorm's num_batches_tracked.add_(1): the input CRC is of the value before the add
    data = first[0]["data"]
    assert data["Tensor.add_.0.forward"]["input_args"][0]["md5"] == f"{zlib.crc32(bytes(8)):08x}"
    # the first batch is the same bytes as in msprobe's run: same CRC
    theirs = _read(MSPROBE_833 / "dumps" / "bench" / "md5_L1", 0)["data"]
    first_input = "Functional.conv2d.0.forward"
    assert (
        data[first_input]["input_args"][0]["md5"] == theirs[first_input]["input_args"][0]["md5"] == "b69f90ec"
    )


def test_md5_from_msprobe_config_file(tmp_path: Path) -> None:
    config = MSPROBE_833 / "configs" / "md5_L1.json"
    debugger = PrecisionDebugger(config_path=config, dump_path=tmp_path)
    assert debugger.config.md5 and debugger.config.steps == frozenset({0, 1})
    debugger.start()
    torch.ones(2).mul(3)
    debugger.close()
    item = _read(tmp_path, 0)["data"]["Tensor.mul.0.forward"]["output"][0]
    assert item["md5"] == f"{zlib.crc32(torch.full((2,), 3.0).numpy().tobytes()):08x}"
    assert item["Max"] == 3.0
