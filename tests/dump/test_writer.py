"""Files are written atomically in msprobe's layout; tensor files load safely."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytest_msprobe.dump import writer
from pytest_msprobe.errors import DumpError


def test_render_mapping_is_valid_json_with_one_entry_per_line() -> None:
    data = {"A.0.forward": {"input_args": [1, None]}, "B.0.forward": {"output": [{"Max": 1.5}]}}
    text = writer.render_mapping({"task": "statistics", "dump_data_dir": None}, "data", data)
    assert json.loads(text) == {"task": "statistics", "dump_data_dir": None, "data": data}
    assert sum(1 for line in text.splitlines() if line.startswith('  "')) == len(data)
    assert json.loads(writer.render_mapping({}, "data", {})) == {"data": {}}
    assert json.loads(writer.render_mapping({}, None, {"x": None})) == {"x": None}


def test_step_files_layout(tmp_path: Path) -> None:
    folder = writer.step_dir(tmp_path / "my dump (ü)", 3)
    assert folder == tmp_path / "my dump (ü)" / "step3" / "rank"
    writer.write_step_files(folder, {"task": "statistics"}, {"X.0.forward": {}}, {"0": [["X"], []]}, {})
    assert sorted(p.name for p in folder.iterdir()) == ["construct.json", "dump.json", "stack.json"]
    assert json.loads((folder / "dump.json").read_text())["data"] == {"X.0.forward": {}}
    assert json.loads((folder / "construct.json").read_text()) == {}


def test_failed_write_keeps_the_previous_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "dump.json"
    writer.atomic_write_text(target, '{"old": true}')

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(DumpError, match=r"dump\.json: cannot write"):
        writer.atomic_write_text(target, '{"new": true}')
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["dump.json"]


def test_tensor_writer_saves_loadable_files_when_joined(tmp_path: Path) -> None:
    tensors = {f"T.{i}.forward.input.0.pt": torch.randn(3, i + 1) for i in range(5)}
    folder = tmp_path / "dump_tensor_data"
    w = writer.TensorWriter(folder)
    for name, t in tensors.items():
        w.submit(name, t)
    assert not folder.exists() and not list(tmp_path.iterdir())  # nothing written while capture runs
    w.join()
    for name, t in tensors.items():
        loaded = torch.load(folder / name, weights_only=True)
        assert torch.equal(loaded, t)
    assert [p.name for p in tmp_path.iterdir()] == ["dump_tensor_data"]


def test_tensor_writer_spills_past_its_memory_budget(tmp_path: Path) -> None:
    entered: list[bool] = []

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        entered.append(True)
        yield

    w = writer.TensorWriter(tmp_path / "dump_tensor_data", max_pending_bytes=100, quiet=quiet)
    w.submit("small.pt", torch.ones(4))  # 16 bytes: kept
    assert w.files_written == 0
    w.submit("big.pt", torch.ones(40))  # 176 bytes pending: both saved now, inside quiet()
    assert w.files_written == 2 and entered == [True]
    w.join()
    assert sorted(p.name for p in (tmp_path / "dump_tensor_data").iterdir()) == ["big.pt", "small.pt"]


def test_tensor_writer_reports_a_failure_on_join(tmp_path: Path) -> None:
    blocker = tmp_path / "dump_tensor_data"
    blocker.write_text("a file where the folder should be")
    w = writer.TensorWriter(blocker)
    w.submit("x.pt", torch.ones(1))
    with pytest.raises(DumpError, match="dump_tensor_data"):
        w.join()


def test_tensor_files_appear_together_when_published(tmp_path: Path) -> None:
    folder = tmp_path / "step0" / "rank" / "dump_tensor_data"
    w = writer.TensorWriter(folder)
    w.submit("a.pt", torch.ones(2))
    w.submit("b.pt", torch.zeros(2))
    w.join()
    assert sorted(p.name for p in folder.iterdir()) == ["a.pt", "b.pt"]
    w.submit("c.pt", torch.ones(1))  # a later stop() in the same step adds to the published files
    w.join()
    assert sorted(p.name for p in folder.iterdir()) == ["a.pt", "b.pt", "c.pt"]
    assert [p.name for p in folder.parent.iterdir()] == ["dump_tensor_data"]


@pytest.mark.parametrize("inline", [False, True])
def test_a_job_s_failure_is_reported_by_the_next_wait_on_the_thread_or_inline(inline: bool) -> None:
    jobs = writer.BackgroundJobs()
    ran: list[int] = []

    def fails() -> None:
        ran.append(threading.get_ident())
        raise OSError(28, "No space left on device")

    jobs.submit(fails, inline=inline)  # never raises itself: the step's stop() has handed its files over
    jobs.join()
    assert (ran[0] == threading.get_ident()) is inline
    with pytest.raises(DumpError, match=r"writing the dump failed: .*No space left on device"):
        jobs.wait()
    jobs.wait()  # reported once
    assert jobs.last_cpu is not None and jobs.last_cpu >= 0


def test_a_job_runs_inline_when_its_cpu_time_is_large_beside_the_capture() -> None:
    jobs = writer.BackgroundJobs()
    assert not jobs.wants_inline(0.010), "the first job, with nothing measured yet, goes to the thread"
    jobs.submit(lambda: sum(range(200_000)))
    jobs.wait()
    cpu = jobs.last_cpu
    assert cpu is not None and cpu > 0
    assert jobs.wants_inline(cpu * 2)  # the job costs half the capture: inline
    assert not jobs.wants_inline(cpu * 10)  # a tenth: on the thread, beside the next step
