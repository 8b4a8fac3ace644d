"""The tensor files of task tensor: written by the plugin's own writer, read back by torch.load as torch.save's."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from pytest_msprobe.dump.torchsave import covered, save_tensor

_CASES = {
    "float32 2-d": torch.randn(3, 4),
    "0-d": torch.tensor(2.5),
    "empty": torch.empty(0, 3),
    "int64": torch.arange(10),
    "bfloat16": torch.randn(5).bfloat16(),
    "float16": torch.randn(5).half(),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.randn(3, dtype=torch.complex64),
    "uint8": torch.arange(200, dtype=torch.uint8),
    "int8": torch.arange(-5, 5, dtype=torch.int8),
    "float64 4-d": torch.randn(2, 3, 4, 5, dtype=torch.float64),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_torch_load_reads_back_what_was_written(tmp_path: Path, name: str) -> None:
    t = _CASES[name]
    path = tmp_path / "Functional.conv2d.0.forward.input.0.pt"
    save_tensor(t, path)
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert type(back) is torch.Tensor
        assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
        assert back.requires_grad is False
        assert torch.equal(back, t)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record's CRC-32 is right
        names = archive.namelist()
        assert names[0] == "Functional.conv2d.0.forward.input.0/data.pkl"
        data = archive.getinfo("Functional.conv2d.0.forward.input.0/data/0")
    raw = path.read_bytes()
    # the tensor's bytes lie whole, at a multiple of 64 as torch.save aligns them (what mmap loading relies on)
    extra_len = int.from_bytes(raw[data.header_offset + 28 : data.header_offset + 30], "little")
    start = data.header_offset + 30 + len(data.filename.encode()) + extra_len
    assert start % 64 == 0
    assert (
        raw[start : start + data.file_size] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(4, 5).t(),  # not contiguous
        torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        torch.randn(10)[2:5],  # a view into a larger storage
        torch.randn(3, requires_grad=True),
        torch.randn(3, dtype=torch.complex64).conj(),
    ],
    ids=["transposed", "channels_last", "view", "requires_grad", "conjugate"],
)
def test_tensors_the_writer_does_not_cover_go_through_torch_save(tmp_path: Path, t: torch.Tensor) -> None:
    assert not covered(t)
    path = tmp_path / "x.pt"
    save_tensor(t, path)
    back = torch.load(path, weights_only=True)
    assert torch.equal(back.resolve_conj(), t.detach().resolve_conj())
    assert back.stride() == t.stride()
    assert back.requires_grad == t.requires_grad


def test_the_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    save_tensor(torch.randn(1000), path)
    save_tensor(torch.ones(2), path)  # a shorter file over a longer one: nothing of the old is left
    assert torch.equal(torch.load(path, weights_only=True), torch.ones(2))


def test_a_dumped_step_s_tensor_files_load_with_torch(tmp_path: Path) -> None:
    from pytest_msprobe import PrecisionDebugger

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    debugger = PrecisionDebugger(dump_path=tmp_path, task="tensor", level="L1", step=[0])
    x = torch.randn(2, 4)
    debugger.start(model=model)
    model(x).sum().backward()
    debugger.stop()
    debugger.close()
    files = sorted((tmp_path / "step0" / "rank" / "dump_tensor_data").glob("*.pt"))
    assert files
    weight_input = [f for f in files if f.name.startswith("Functional.linear.0.forward.input.0")]
    assert weight_input and torch.equal(torch.load(weight_input[0], weights_only=True), x)
    for f in files:
        assert isinstance(torch.load(f, weights_only=True), torch.Tensor)
