"""Devices and ranks: statistics computed where the tensors live; rank folders under torch.distributed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _available(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available()
    if device == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    return True


def _run(tmp_path: Path, device: str, task: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=gen).to(device).requires_grad_()
    x = torch.randn(5, 4, generator=gen).to(device)
    with PrecisionDebugger(dump_path=tmp_path / device / task, task=task, level="L1") as debugger:
        debugger.start()
        F.relu(F.linear(x, weight)).sum().backward()
        debugger.stop()
    return json.loads((tmp_path / device / task / "step0" / "rank" / "dump.json").read_text())


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_accelerator_dump_matches_cpu(tmp_path: Path, device: str) -> None:
    if not _available(device):
        pytest.skip(f"no {device} device on this machine")
    for task in ("statistics", "md5", "tensor"):
        on_device = _run(tmp_path, device, task)["data"]
        on_cpu = _run(tmp_path, "cpu", task)["data"]
        assert list(on_device) == list(on_cpu)
        for name, entry in on_cpu.items():
            for key in ("input_args", "output", "input"):
                for ours, ref in zip(entry.get(key, []), on_device[name].get(key, [])):
                    if isinstance(ref, dict) and ref.get("type") == "torch.Tensor":
                        assert ours["shape"] == ref["shape"]
                        assert ours["Max"] == pytest.approx(ref["Max"], rel=1e-4, abs=1e-6)
                        assert ours["Norm"] == pytest.approx(ref["Norm"], rel=1e-4, abs=1e-6)
                        if task == "md5":
                            assert len(ours["md5"]) == 8 and len(ref["md5"]) == 8
    folder = tmp_path / device / "tensor" / "step0" / "rank" / "dump_tensor_data"
    for path in folder.iterdir():
        assert torch.load(path, weights_only=True).device.type == "cpu"


def test_rank_folder_under_torch_distributed(tmp_path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with PrecisionDebugger(dump_path=tmp_path / "dump", level="L1") as debugger:
            debugger.start()
            F.relu(torch.ones(2))
            debugger.stop()
    finally:
        dist.destroy_process_group()
    assert sorted(p.name for p in (tmp_path / "dump" / "step0").iterdir()) == ["rank0"]
