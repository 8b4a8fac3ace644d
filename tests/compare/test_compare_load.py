"""Finding dumps in every layout, parsing dump.json, naming rows the way msprobe does."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import openpyxl
import pytest
from compare_helpers import DATA, dump_dir, rank_dir, tensor, write_dump

from pytest_msprobe.compare.dumps.reader import (
    INPUT,
    NONE,
    OUTPUT,
    PARAMETER,
    TENSOR,
    VALUE,
    flatten_entry,
    read_dump,
    read_stack,
    tensor_path,
)
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.layout import discover
from pytest_msprobe.format.names import parse_name


@pytest.mark.parametrize("version", ["8.3.3", "26.2.0"])
def test_every_layout_of_a_real_dump(version: str) -> None:
    root = dump_dir(version, "npu", "stat_L1")
    everything = discover(root)
    assert [(loc.step, loc.rank) for loc in everything] == [(0, 0), (1, 0)]
    one_rank = rank_dir(version, "npu", "stat_L1", 1)
    for path in (root / "step1", one_rank, one_rank / "dump.json"):
        (loc,) = discover(path)
        assert (loc.step, loc.rank, loc.path) == (1, 0, one_rank / "dump.json")
    assert everything[0].rank_dir == (
        "rank" if version == "8.3.3" else rank_dir(version, "npu", "stat_L1", 0).name
    )


def test_ranks_and_procs_are_numbered(tmp_path: Path) -> None:
    item: dict[str, Any] = {"Functional.relu.0.forward": {"input_args": [], "input_kwargs": {}, "output": []}}
    for step in (0, 2):
        for rank in ("rank3", "rank0", "rank12"):
            write_dump(tmp_path / "dist" / f"step{step}" / rank, item)
        for pid in ("proc900", "proc77"):
            write_dump(tmp_path / "procs" / f"step{step}" / pid, item)
    found = [(loc.step, loc.rank, loc.rank_dir) for loc in discover(tmp_path / "dist")]
    assert found == [
        (0, 0, "rank0"),
        (0, 3, "rank3"),
        (0, 12, "rank12"),
        (2, 0, "rank0"),
        (2, 3, "rank3"),
        (2, 12, "rank12"),
    ]
    # processes without ranks are numbered in PID order, numerically
    assert [(loc.rank, loc.rank_dir) for loc in discover(tmp_path / "procs" / "step2")] == [
        (0, "proc77"),
        (1, "proc900"),
    ]


def test_a_dump_json_outside_the_layout_has_no_step_or_rank(tmp_path: Path) -> None:
    path = write_dump(tmp_path / "loose", {})
    (loc,) = discover(path)
    assert (loc.step, loc.rank) == (None, None)


@pytest.mark.parametrize(
    "setup, problem",
    [
        (lambda p: None, "no such file"),
        (lambda p: p.mkdir(), "no dump.json found"),
        (lambda p: p.write_text("x"), "expected a dump.json"),
    ],
    ids=["missing", "empty-folder", "not-json-file"],
)
def test_unusable_paths(tmp_path: Path, setup: object, problem: str) -> None:
    path = tmp_path / "target"
    setup(path)  # type: ignore[operator]
    with pytest.raises(DumpFormatError, match=problem) as info:
        discover(path)
    assert info.value.path == str(path)


@pytest.mark.parametrize(
    "kind, step", [("stat_L1", 0), ("stat_L1", 1), ("stat_mix", 0), ("tensor_L1", 0), ("md5_L1", 0)]
)
def test_rows_are_named_and_ordered_as_msprobe_names_them(kind: str, step: int) -> None:
    """The NPU Name column of msprobe 8.3.3's own compare of these dumps, row for row."""
    (xlsx,) = (DATA / "msprobe-8.3.3" / "compare" / f"npu_vs_bench_{kind}_step{step}").glob("*.xlsx")
    sheet = openpyxl.load_workbook(xlsx, read_only=True).active
    msprobe_rows = [row[0] for row in sheet.iter_rows(min_row=2, values_only=True)]
    dump = read_dump(discover(dump_dir("8.3.3", "npu", kind, step))[0])
    assert [leaf.name for entry in dump.entries for leaf in entry.leaves] == msprobe_rows


def test_flattening_roles_kinds_and_values() -> None:
    entry = {
        "input_args": [
            tensor([2, 3], -1.0, 2.0, 0.5, 3.0, requires_grad=True, data_name="x.pt"),
            None,
            [{"type": "int", "value": 1}, {"type": "int", "value": 2}],
        ],
        "input_kwargs": {"reduction": {"type": "str", "value": "mean"}, "weight": None},
        "parameters": {"weight": tensor([3], 0.0, 1.0, 0.5, 1.1)},
        "output": [tensor([2], 0.0, 1.0, 0.5, 1.0, md5="0badf00d")],
        "is_recompute": False,
    }
    leaves = flatten_entry("Functional.linear.0.forward", entry)
    assert [(leaf.suffix, leaf.role, leaf.kind) for leaf in leaves] == [
        (".input.0", INPUT, TENSOR),
        (".input.1", INPUT, NONE),
        (".input.2.0", INPUT, VALUE),
        (".input.2.1", INPUT, VALUE),
        (".input.reduction", INPUT, VALUE),
        (".input.weight", INPUT, NONE),
        (".parameters.weight", PARAMETER, TENSOR),
        (".output.0", OUTPUT, TENSOR),
    ]
    x = leaves[0]
    assert (x.dtype, x.shape, x.stats, x.requires_grad, x.data_name) == (
        "torch.float32",
        (2, 3),
        (2.0, -1.0, 0.5, 3.0),
        True,
        "x.pt",
    )
    assert leaves[4].value == "mean" and leaves[7].md5 == "0badf00d"
    # a module's parameter gradients: one list per parameter, not indexed in the row name
    grads = flatten_entry(
        "Module.fc.Linear.parameters_grad", {"weight": [tensor([2], 0, 1, 0.5, 1)], "bias": [None]}
    )
    assert [(leaf.name, leaf.role) for leaf in grads] == [
        ("Module.fc.Linear.parameters_grad.weight", OUTPUT),
        ("Module.fc.Linear.parameters_grad.bias", OUTPUT),
    ]


def test_bare_values_and_distributed_records_become_value_rows() -> None:
    p2p = {
        "class_type": "torch.distributed.P2POp",
        "op": "isend",
        "peer": 1,
        "tensor": tensor([2], 0.0, 1.0, 0.5, 1.0),
    }
    leaves = flatten_entry(
        "Distributed.batch_isend_irecv.0.forward", {"input_args": [[p2p], 7], "output": []}
    )
    assert [(leaf.suffix, leaf.kind, leaf.value) for leaf in leaves] == [
        (".input.0.0.class_type", VALUE, "torch.distributed.P2POp"),
        (".input.0.0.op", VALUE, "isend"),
        (".input.0.0.peer", VALUE, 1),
        (".input.0.0.tensor", TENSOR, None),
        (".input.1", VALUE, 7),
    ]


def test_statistics_written_as_strings_are_read() -> None:
    item: dict[str, Any] = {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": [2],
        "Max": "inf",
        "Min": "-inf",
    }
    item.update({"Mean": "nan", "Norm": "N/A"})
    (leaf,) = flatten_entry("A.b.0.forward", {"output": [item]})
    assert leaf.max == float("inf") and leaf.min == float("-inf")
    assert leaf.mean != leaf.mean and leaf.norm is None
    item["Norm"] = "garbage"  # any other text is a broken record (tests/compare/test_hostile_inputs.py)
    with pytest.raises(ValueError) as info:
        flatten_entry("A.b.0.forward", {"output": [item]})
    assert str(info.value) == "A.b.0.forward.output.0: Norm is 'garbage', not a number"


@pytest.mark.parametrize(
    "name, base, counter, direction",
    [
        ("Functional.relu.2.forward", "Functional.relu", 2, "forward"),
        ("Tensor.__add__.10.backward", "Tensor.__add__", 10, "backward"),
        ("Aten.add.Tensor.0.forward", "Aten.add.Tensor", 0, "forward"),
        ("Module.layer1.0.conv1.Conv2d.forward.3", "Module.layer1.0.conv1.Conv2d", 3, "forward"),
        ("Module.fc.Linear.parameters_grad", "Module.fc.Linear.parameters_grad", None, "backward"),
        ("Module.fc.Linear.parameters_grad.0", "Module.fc.Linear.parameters_grad", 0, "backward"),
        ("weird", "weird", None, None),
    ],
)
def test_parse_name(name: str, base: str, counter: int | None, direction: str | None) -> None:
    parts = parse_name(name)
    assert (parts.base, parts.counter, parts.direction) == (base, counter, direction)


def test_forward_and_backward_names_of_the_same_call() -> None:
    assert parse_name("Functional.relu.2.backward").with_direction("forward") == "Functional.relu.2.forward"
    assert parse_name("Module.fc.Linear.backward.1").with_direction("forward") == "Module.fc.Linear.forward.1"


def _dump_with_tensor_dir(tmp_path: Path) -> object:
    folder = tmp_path / "d" / "step0" / "rank"
    write_dump(folder, {"Functional.relu.0.forward": {"output": [None]}}, task="tensor")
    (folder / "dump_tensor_data").mkdir()
    (folder / "dump_tensor_data" / "ok.pt").write_bytes(b"x")
    return read_dump(discover(tmp_path / "d")[0])


@pytest.mark.parametrize(
    "name", ["../dump.json", "../../secret.pt", "/etc/passwd", "a/../../x.pt", "", "sub/"]
)
def test_data_names_that_leave_the_dump_folder_are_refused(tmp_path: Path, name: str) -> None:
    dump = _dump_with_tensor_dir(tmp_path)
    with pytest.raises(DumpFormatError) as info:
        tensor_path(dump, name)  # type: ignore[arg-type]
    assert info.value.path.endswith("dump.json")


def test_symlinks_out_of_the_dump_folder_are_refused(tmp_path: Path) -> None:
    dump = _dump_with_tensor_dir(tmp_path)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x")
    link = dump.tensor_dir / "link.pt"  # type: ignore[attr-defined]
    os.symlink(outside, link)
    with pytest.raises(DumpFormatError, match="through a link"):
        tensor_path(dump, "link.pt")  # type: ignore[arg-type]
    assert tensor_path(dump, "ok.pt").name == "ok.pt"  # type: ignore[arg-type]


def test_missing_tensor_file_names_the_file(tmp_path: Path) -> None:
    dump = _dump_with_tensor_dir(tmp_path)
    with pytest.raises(DumpFormatError, match="missing") as info:
        tensor_path(dump, "absent.pt")  # type: ignore[arg-type]
    assert info.value.path.endswith("absent.pt")


def test_tensors_are_found_beside_the_dump_json_not_at_dump_data_dir() -> None:
    dump = read_dump(discover(dump_dir("8.3.3", "npu", "tensor_L1", 0))[0])
    assert json.loads(dump.path.read_text())["dump_data_dir"].startswith("/workspace")
    leaf = dump.entries[0].leaves[0]
    assert tensor_path(dump, leaf.data_name or "").is_file()


@pytest.mark.parametrize("version", ["8.3.3", "26.2.0"])
def test_stacks(version: str) -> None:
    stacks = read_stack(rank_dir(version, "npu", "stat_L1", 0) / "dump.json")
    assert "Functional.relu.2.forward" in stacks
    assert any("make_dumps.py" in frame for frame in stacks["Functional.relu.2.forward"])


def test_stacks_absent_or_broken(tmp_path: Path) -> None:
    assert read_stack(tmp_path / "dump.json") == {}
    (tmp_path / "stack.json").write_text("{broken")
    assert read_stack(tmp_path / "dump.json") == {}
    (tmp_path / "stack.json").write_text(json.dumps({"Functional.relu.0.forward": ["File a.py, line 1"]}))
    assert read_stack(tmp_path / "dump.json") == {"Functional.relu.0.forward": ["File a.py, line 1"]}
