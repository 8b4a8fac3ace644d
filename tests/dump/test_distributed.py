"""The dump under torch.distributed, with two real gloo ranks on the CPU.

The ranks run ``dist_ranks.py`` once for the whole module (its docstring lists what they make); the DDP example
is also run as a user runs it, for a rerun, a faulty rank and the rank filter of its command line.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.processes import children

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp" / "train_ddp.py"
RANKS = Path(__file__).with_name("dist_ranks.py")

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is needed",
)


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _load_example()


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory: pytest.TempPathFactory, example: ModuleType) -> Path:
    """What two gloo ranks of ``dist_ranks.py`` wrote."""
    out = tmp_path_factory.mktemp("dist")
    assert example.launch(RANKS, [str(out)], world_size=2, timeout=240) == 0
    return out


def _data(folder: Path, step: int, rank: int) -> dict[str, Any]:
    text = (folder / f"step{step}" / f"rank{rank}" / "dump.json").read_text()
    data: dict[str, Any] = json.loads(text)["data"]
    return data


def _stat(item: dict[str, Any]) -> tuple[Any, ...]:
    return (item["shape"], item["Max"], item["Min"], item["Mean"])


# -- collectives at L1 ---------------------------------------------------------------------------------------------


def test_each_rank_writes_its_own_folder(ranks_out: Path) -> None:
    folder = ranks_out / "collectives"
    assert sorted(p.name for p in (folder / "step0").iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        assert {p.name for p in (folder / "step0" / f"rank{rank}").iterdir()} >= {
            "dump.json",
            "stack.json",
            "construct.json",
        }


@pytest.mark.parametrize("rank", [0, 1])
def test_all_reduce_records_its_input_reduced_output_and_op(ranks_out: Path, rank: int) -> None:
    data = _data(ranks_out / "collectives", 0, rank)
    first = data["Distributed.all_reduce.0.forward"]
    assert _stat(first["input_args"][0]) == ([4], rank + 1.0, rank + 1.0, rank + 1.0)
    assert _stat(first["output"][0]) == ([4], 3.0, 3.0, 3.0)  # the tensor reduced in place
    op = data["Distributed.all_reduce.1.forward"]["input_kwargs"]["op"]
    assert op == {"type": "torch.distributed.ReduceOp", "value": "RedOpType.MAX"}
    group = data["Distributed.all_reduce.3.forward"]["input_kwargs"]["group"]
    expected_id = f"{zlib.crc32(b'[0, 1]'):08x}"
    assert group == {"type": "torch.ProcessGroup", "group_ranks": [0, 1], "group_id": expected_id}


@pytest.mark.parametrize("rank", [0, 1])
def test_every_collective_and_point_to_point_call_is_recorded(ranks_out: Path, rank: int) -> None:
    data = _data(ranks_out / "collectives", 0, rank)
    names = [k for k in data if k.startswith("Distributed.")]
    sent = "Distributed.send.0.forward" if rank == 0 else "Distributed.recv.0.forward"
    single = (
        ["Distributed.all_gather_single.0.forward"] if hasattr(torch.distributed, "all_gather_single") else []
    )
    assert names == [
        "Distributed.all_reduce.0.forward",
        "Distributed.all_reduce.1.forward",
        "Distributed.broadcast.0.forward",
        "Distributed.all_gather.0.forward",
        "Distributed.all_gather_into_tensor.0.forward",
        *single,
        "Distributed.reduce_scatter.0.forward",
        "Distributed.reduce.0.forward",
        "Distributed.all_reduce.2.forward",
        sent,
        "Distributed.isend.0.forward",
        "Distributed.irecv.0.forward",
        "Distributed.batch_isend_irecv.0.forward",
        "Distributed.all_reduce.3.forward",
    ]
    # the calls inside torch.distributed (all_gather_into_tensor's own collective) are not recorded twice
    assert all(data[n]["output"] for n in names)
    broadcast = data["Distributed.broadcast.0.forward"]
    assert _stat(broadcast["output"][0]) == ([3], 2.0, 0.0, 1.0)
    gathered = data["Distributed.all_gather.0.forward"]["output"][0]
    assert [_stat(t) for t in gathered] == [([2], 0.0, 0.0, 0.0), ([2], 1.0, 1.0, 1.0)]
    flat = data["Distributed.all_gather_into_tensor.0.forward"]
    assert _stat(flat["input_args"][0]) == ([4], 0.0, 0.0, 0.0)
    assert _stat(flat["output"][0]) == ([4], 1.0, 0.0, 0.5)
    reduce_scatter = data["Distributed.reduce_scatter.0.forward"]
    # rank r sends i + r to rank i: rank i receives i + 0 + i + 1
    assert _stat(reduce_scatter["output"][0]) == ([2], 2.0 * rank + 1, 2.0 * rank + 1, 2.0 * rank + 1)
    reduced = data["Distributed.reduce.0.forward"]["output"][0]
    if rank == 0:
        assert _stat(reduced) == ([2], 3.0, 3.0, 3.0)


@pytest.mark.parametrize("rank", [0, 1])
def test_asynchronous_calls_are_recorded_when_waited_for(ranks_out: Path, rank: int) -> None:
    data = _data(ranks_out / "collectives", 0, rank)
    async_reduce = data["Distributed.all_reduce.2.forward"]
    assert async_reduce["input_kwargs"]["async_op"] == {"type": "bool", "value": True}
    assert _stat(async_reduce["output"][0]) == ([3], 3.0, 3.0, 3.0)
    irecv = data["Distributed.irecv.0.forward"]
    peer = 1 - rank
    assert _stat(irecv["input_args"][0]) == ([2], 0.0, 0.0, 0.0)
    assert _stat(irecv["output"][0]) == ([2], peer + 10.0, peer + 10.0, peer + 10.0)
    batch = data["Distributed.batch_isend_irecv.0.forward"]
    send_op, recv_op = batch["output"][0]
    assert send_op["op"] == "isend" and recv_op["op"] == "irecv" and recv_op["peer"] == peer
    assert recv_op["class_type"] == "torch.distributed.P2POp"
    assert _stat(recv_op["tensor"]) == ([2], peer + 20.0, peer + 20.0, peer + 20.0)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_files_of_an_in_place_collective_hold_before_and_after(ranks_out: Path, rank: int) -> None:
    folder = ranks_out / "tensors" / "step0" / f"rank{rank}" / "dump_tensor_data"
    assert sorted(p.name for p in folder.iterdir()) == [
        f"Distributed.all_reduce.{n}.forward.{io}.0.pt" for n in (0, 1) for io in ("input", "output")
    ]
    expected = {(0, "input"): rank + 1.0, (0, "output"): 3.0, (1, "input"): 3.0, (1, "output"): 6.0}
    for (n, io), value in expected.items():
        saved = torch.load(folder / f"Distributed.all_reduce.{n}.forward.{io}.0.pt", weights_only=True)
        assert torch.equal(saved, torch.full((4,), value))


def test_ranks_left_out_dump_nothing_and_still_take_part(ranks_out: Path) -> None:
    folder = ranks_out / "filtered"
    assert sorted(p.name for p in (folder / "step0").iterdir()) == ["rank1"]
    assert "Distributed.all_reduce.0.forward" in _data(folder, 0, 1)
    for rank in (0, 1):
        assert json.loads((ranks_out / f"filtered_rank{rank}.json").read_text()) == [3.0, 3.0]


@pytest.mark.parametrize("rank", [0, 1])
def test_functional_all_reduce_has_forward_and_backward(ranks_out: Path, rank: int) -> None:
    data = _data(ranks_out / "functional", 0, rank)
    forward = data["Distributed.all_reduce.0.forward"]
    assert _stat(forward["input_args"][0]) == ([3], 2.0 * (rank + 1), 2.0 * (rank + 1), 2.0 * (rank + 1))
    assert _stat(forward["output"][0]) == ([3], 6.0, 6.0, 6.0)
    backward = data["Distributed.all_reduce.0.backward"]
    # the incoming gradient is rank + 1; the backward of an all_reduce sums it over the ranks
    assert _stat(backward["input"][0]) == ([3], rank + 1.0, rank + 1.0, rank + 1.0)
    assert _stat(backward["output"][0]) == ([3], 3.0, 3.0, 3.0)


# -- DDP -------------------------------------------------------------------------------------------------------


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1)))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("level", ["L1", "mix"])
@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_numbers_are_unchanged_by_dumping(ranks_out: Path, level: str, rank: int) -> None:
    plain = torch.load(ranks_out / f"ddp_plain_rank{rank}.pt", weights_only=True)
    dumped = torch.load(ranks_out / f"ddp_{level}_rank{rank}.pt", weights_only=True)
    assert len(plain["losses"]) == 2 and plain["grads"][0]
    assert _bitwise_equal(plain, dumped)


def test_ddp_at_l1_records_each_rank(ranks_out: Path) -> None:
    for rank in (0, 1):
        data = _data(ranks_out / "ddp_L1", 1, rank)
        assert "Functional.conv2d.0.forward" in data and "Functional.conv2d.0.backward" in data
        assert not any(k.startswith("Module.") for k in data)
    # each rank trains on its own batch
    conv = "Functional.conv2d.0.forward"
    inputs = [_data(ranks_out / "ddp_L1", 0, rank)[conv]["input_args"][0] for rank in (0, 1)]
    assert inputs[0] != inputs[1]


def test_ddp_at_mix_names_modules_inside_the_wrapper(ranks_out: Path) -> None:
    data = [_data(ranks_out / "ddp_mix", 0, rank) for rank in (0, 1)]
    for d in data:
        assert "Module.module.conv1.Conv2d.forward.0" in d
        assert "Module.module.layer1.conv1.Conv2d.backward.0" in d
        assert "Module.module.TinyResNet.forward.0" in d
        assert "Functional.conv2d.0.forward" in d
    # parameter gradients are recorded after DDP's all-reduce: the same on both ranks, and equal to what
    # the optimizer used (the .grad the training kept)
    grads = torch.load(ranks_out / "ddp_mix_rank0.pt", weights_only=True)["grads"][0]
    for name, param in (("module.fc.Linear", "weight"), ("module.layer1.conv1.Conv2d", "weight")):
        key = f"Module.{name}.parameters_grad"
        assert data[0][key][param] == data[1][key][param]
        kept = grads[f"{name.rsplit('.', 1)[0].removeprefix('module.')}.{param}"]
        assert data[0][key][param][0]["Max"] == pytest.approx(float(kept.max()), rel=0, abs=0)
    losses = [torch.load(ranks_out / f"ddp_mix_rank{r}.pt", weights_only=True)["losses"][0] for r in (0, 1)]
    assert not torch.equal(losses[0], losses[1])  # different batches, the same all-reduced gradients


# -- the example, as a user runs it ----------------------------------------------------------------------------


def _run_example(example: ModuleType, *args: str, world_size: int = 2) -> None:
    assert example.launch(EXAMPLE, ["--world-size", str(world_size), *args], world_size, timeout=240) == 0


def test_example_rerun_gives_the_same_dumps_and_numbers(
    tmp_path: Path, ranks_out: Path, example: ModuleType
) -> None:
    again = tmp_path / "again"
    results = tmp_path / "results"
    _run_example(example, "--dump-path", str(again), "--steps", "2", "--results", str(results))
    for step in (0, 1):
        for rank in (0, 1):
            assert _data(again, step, rank) == _data(ranks_out / "ddp_L1", step, rank)
    for rank in (0, 1):
        saved = torch.load(results / f"rank{rank}.pt", weights_only=True)
        assert _bitwise_equal(saved, torch.load(ranks_out / f"ddp_L1_rank{rank}.pt", weights_only=True))


def test_example_fault_on_one_rank_shows_first_at_its_relu(
    tmp_path: Path, ranks_out: Path, example: ModuleType
) -> None:
    faulty = tmp_path / "faulty"
    _run_example(example, "--dump-path", str(faulty), "--steps", "2", "--fault-rank", "1", "--rank", "1")
    assert sorted(p.name for p in (faulty / "step0").iterdir()) == ["rank1"]
    clean, bad = _data(ranks_out / "ddp_L1", 0, 1), _data(faulty, 0, 1)
    names = [k for k in clean if clean[k] != bad.get(k)]
    assert names and names[0] == "Functional.relu.1.forward"
    out_clean, out_bad = clean[names[0]]["output"][0], bad[names[0]]["output"][0]
    assert out_bad["Max"] == pytest.approx(out_clean["Max"] * 1.01, rel=1e-6)
    assert clean[names[0]]["input_args"] == bad[names[0]]["input_args"]


def test_example_fault_on_rank_one_is_named_on_rank_one_by_the_compare(
    tmp_path: Path, ranks_out: Path, example: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_msprobe.cli import main

    faulty, out = tmp_path / "faulty", tmp_path / "compare"
    _run_example(example, "--dump-path", str(faulty), "--steps", "2", "--fault-rank", "1")
    assert main(["compare", str(faulty), str(ranks_out / "ddp_L1"), "-o", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    first = summary["first_divergence"]
    assert (first["api"], first["step"], first["rank"]) == ("Functional.relu.1.forward", 0, 1)
    # DDP's all-reduce carried the error into rank 0's gradients, so rank 0 breaches too, but later
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    assert by_rank[0]["passed"] is False and by_rank[1]["passed"] is False
    assert "first divergence: Functional.relu.1.forward (step 0, rank 1)" in capsys.readouterr().out


# -- the example's launcher: one rank's failure ends every rank, at once, with that rank's error ---------------

# rank 1 fails before it joins the process group, as a rank whose device does not exist does; rank 0 is left
# waiting for it in init_process_group (its timeout is far longer than any test's)
EARLY_FAILURE = textwrap.dedent(
    """
    import datetime
    import os
    import signal
    import sys
    import time

    import torch.distributed as dist

    how = sys.argv[1]
    if os.environ["RANK"] == "1":
        time.sleep(1)  # rank 0 is in the rendezvous by now
        if how == "raises":
            raise RuntimeError("rank 1 cannot start: invalid device ordinal")
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
    if how == "ignores-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=600))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
@pytest.mark.parametrize(
    ("how", "headline", "error"),
    [
        (
            "raises",
            "rank 1 of 2 failed (exit status 1); rank 0 stopped",
            "RuntimeError: rank 1 cannot start: invalid device ordinal",
        ),
        ("killed", "rank 1 of 2 failed (killed by SIGKILL); rank 0 stopped", "(nothing)"),
        ("exits", "rank 1 of 2 failed (exit status 3); rank 0 stopped", "(nothing)"),
        ("ignores-sigterm", "rank 1 of 2 failed (exit status 3); rank 0 stopped", "(nothing)"),
    ],
)
def test_example_launcher_stops_every_rank_when_one_fails_before_joining(
    tmp_path: Path, example: ModuleType, how: str, headline: str, error: str
) -> None:
    script = tmp_path / "early.py"
    script.write_text(EARLY_FAILURE)
    with pytest.raises(example.RankFailure) as failure:
        example.launch(script, [how], world_size=2, timeout=300, grace=2)
    message = str(failure.value)
    lines = message.splitlines()
    assert lines[0] == headline  # not the timeout's "still running after 300 s"
    assert lines[1] == "rank 1's error output (end):" and error in message
    assert failure.value.status == (3 if how in ("exits", "ignores-sigterm") else 1)
    assert children() == []  # rank 0, blocked in the rendezvous, was stopped and reaped


def test_example_refuses_more_ranks_than_devices(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert example.main(["--device", "cuda", "--world-size", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "train_ddp.py: --world-size 2 needs 2 cuda devices (one per rank), this machine has 1"
    )
    assert example.device_shortage("cuda", 1) is None and example.device_shortage("cpu", 8) is None


# -- the same code paths on accelerators (nccl, hccl): skipped where there are fewer devices than ranks ---------

WORLD = 2  # one device per rank


def _accelerators(device: str) -> int:
    """The devices of this kind that the test can use: none without the collective backend."""
    if device == "cuda":
        ok = torch.cuda.is_available() and torch.distributed.is_nccl_available()
        return torch.cuda.device_count() if ok else 0
    from pytest_msprobe.run.device import npu_usable

    return int(torch.npu.device_count()) if npu_usable() else 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_example_on_accelerators(tmp_path: Path, example: ModuleType, device: str) -> None:
    count = _accelerators(device)
    if count < WORLD:
        pytest.skip(f"needs {WORLD} {device} devices (one per rank), this machine has {count}")
    dump = tmp_path / "dump"
    _run_example(example, "--device", device, "--dump-path", str(dump), "--level", "mix", world_size=WORLD)
    for rank in range(WORLD):
        data = _data(dump, 0, rank)
        assert "Module.module.conv1.Conv2d.forward.0" in data
        grad = data["Module.module.fc.Linear.parameters_grad"]["weight"][0]
        assert grad["shape"] == [10, 16] and grad["Norm"] > 0


def test_accelerator_case_skips_on_one_device(
    tmp_path: Path, example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One GPU for two ranks: a skip naming both counts, before any rank starts (rank 1 had no device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(example, "launch", lambda *a, **k: pytest.fail("no rank may start"))
    with pytest.raises(
        pytest.skip.Exception, match=r"^needs 2 cuda devices \(one per rank\), this machine has 1$"
    ):
        test_example_on_accelerators(tmp_path, example, "cuda")
