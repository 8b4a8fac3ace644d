"""max_dump_size: a tensor dump stops before it takes more than its limit, with a message naming the row."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.dump import writer
from pytest_msprobe.errors import ConfigError, DumpError, DumpSizeError
from pytest_msprobe.settings import format_size, parse_size

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


@pytest.mark.parametrize(
    ("text", "size", "shown"),
    [
        ("500MB", 500 * 10**6, "500 MB"),
        ("2GiB", 2 * 2**30, "2 GiB"),
        ("1.5 gb", 1_500_000_000, "1.5 GB"),
        ("64KiB", 65536, "64 KiB"),
        ("4096", 4096, "4 KiB"),
        (1000, 1000, "1 kB"),
        ("300 B", 300, "300 B"),
    ],
)
def test_sizes_are_read_as_people_write_them(text: Any, size: int, shown: str) -> None:
    assert parse_size(text, "max_dump_size") == size
    assert format_size(size) == shown


@pytest.mark.parametrize("bad", ["500M", "2 GB of it", "-5MB", "0", 0, 0.5, True, "", [1]])
def test_bad_sizes_are_refused_with_the_value(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_dump_size: ") as info:
        parse_size(bad, "max_dump_size")
    assert repr(bad) in str(info.value)


def _tensor_files(root: Path) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".pt")
    }


def _data_names(root: Path, step: int) -> list[str]:
    text = (root / f"step{step}" / "rank" / "dump.json").read_text()
    return [item["data_name"] for item in _items(json.loads(text)["data"]) if "data_name" in item]


def _items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        own = [value] if value.get("type") == "torch.Tensor" else []
        return own + [i for v in value.values() for i in _items(v)]
    if isinstance(value, list):
        return [i for v in value for i in _items(v)]
    return []


def _run(debugger: PrecisionDebugger, make_dumps: Any, steps: int = 2) -> DumpSizeError | None:
    """Two TinyResNet training steps under ``debugger``; the size error stop() raised, if any."""
    torch.manual_seed(1234)
    net = make_dumps.TinyResNet(width=8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(steps):
            x, y = make_dumps.make_batch(step, 8, 16)
            debugger.start()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            debugger.stop()
            debugger.step()
    except DumpSizeError as exc:
        return exc
    finally:
        debugger.close()
    return None


def test_a_tensor_dump_stops_at_its_limit_and_keeps_what_it_wrote_whole(
    tmp_path: Path, make_dumps: Any
) -> None:
    full = _run(PrecisionDebugger(dump_path=tmp_path / "full", task="tensor", step=[0, 1]), make_dumps)
    assert full is None
    whole = _tensor_files(tmp_path / "full")
    assert sum(whole.values()) > 2_000_000

    limited = tmp_path / "limited"
    error = _run(
        PrecisionDebugger(dump_path=limited, task="tensor", step=[0, 1], max_dump_size="200kB"), make_dumps
    )
    assert isinstance(error, DumpSizeError)
    assert str(error) == (
        f"{limited}: the dump reached its 200 kB limit at {error.row}; raise max_dump_size, dump fewer steps "
        "or use task statistics"
    )
    files = _tensor_files(limited)
    assert 0 < sum(files.values()) <= 200_000, "counted as queued, estimated from above: never past the limit"
    # the row named is the first whose file is missing, in execution order
    names = _data_names(tmp_path / "full", 0)
    kept = _data_names(limited, 0)
    assert kept == names[: len(kept)] and names[len(kept)] == error.row + ".pt"
    # every file written is whole and named in dump.json; rows after the limit have no data_name
    folder = limited / "step0" / "rank" / "dump_tensor_data"
    assert sorted(kept) == sorted(p.name for p in folder.iterdir())
    for name in kept:
        saved = torch.load(folder / name, weights_only=True)
        reference = torch.load(
            tmp_path / "full" / "step0" / "rank" / "dump_tensor_data" / name, weights_only=True
        )
        assert torch.equal(saved, reference)
    # the statistics of every row are still there, and nothing hidden is left beside the files
    full_doc = json.loads((tmp_path / "full" / "step0" / "rank" / "dump.json").read_text())
    limited_doc = json.loads((limited / "step0" / "rank" / "dump.json").read_text())
    assert list(limited_doc["data"]) == list(full_doc["data"])
    assert [p.name for p in (limited / "step0" / "rank").iterdir() if p.name.startswith(".")] == []
    assert not (limited / "step1").exists(), "training stopped at the error"


def test_the_limit_counts_every_step(tmp_path: Path, make_dumps: Any) -> None:
    one_step = _run(PrecisionDebugger(dump_path=tmp_path / "one", task="tensor", step=[0]), make_dumps, 1)
    assert one_step is None
    step_size = sum(_tensor_files(tmp_path / "one").values())
    limit = int(step_size * 1.6)  # room for step 0 (and the estimate's margin), not for step 1
    dump = tmp_path / "two"
    error = _run(
        PrecisionDebugger(dump_path=dump, task="tensor", step=[0, 1], max_dump_size=limit), make_dumps
    )
    assert isinstance(error, DumpSizeError) and error.limit == format_size(limit)
    assert len(_data_names(dump, 0)) == len(_data_names(tmp_path / "one", 0)), "step 0 is complete"
    assert 0 < len(_data_names(dump, 1)) < len(_data_names(dump, 0))
    assert sum(_tensor_files(dump).values()) <= limit


def test_statistics_dumps_are_not_limited_and_bad_limits_are_refused(tmp_path: Path, make_dumps: Any) -> None:
    assert _run(PrecisionDebugger(dump_path=tmp_path, task="statistics", max_dump_size=1), make_dumps) is None
    assert (tmp_path / "step1" / "rank" / "dump.json").is_file()
    with pytest.raises(ConfigError, match=r"max_dump_size: .*got '10 parsecs'"):
        PrecisionDebugger(dump_path=tmp_path, task="tensor", max_dump_size="10 parsecs")


@pytest.mark.parametrize("route", ["own writer", "torch.save"])
def test_a_failed_tensor_write_leaves_no_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """The disk fills up at the third file, in the plugin's own tensor writer (an OSError) or in torch.save (a
    RuntimeError), which takes the tensors the own writer does not cover (a transposed one, here)."""
    import errno
    import os

    from pytest_msprobe.dump import torchsave

    calls = {"n": 0}
    if route == "torch.save":
        real_save = torch.save

        def save_until_the_disk_is_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 3:
                Path(f).write_bytes(b"PK\x03\x04 half")
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
        tensor = torch.ones(3, 2).t()
        expected = r"T\.2\.pt: cannot write \(torch\.save failed: .* bytes free on that disk\)"
    else:
        real_writev = os.writev

        def writev_until_the_disk_is_full(fd: int, buffers: Any) -> int:
            calls["n"] += 1
            if calls["n"] == 3:
                os.write(fd, b"PK\x03\x04 half")
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_writev(fd, buffers)

        monkeypatch.setattr(torchsave.os, "writev", writev_until_the_disk_is_full)
        tensor = torch.ones(3)
        expected = r"T\.2\.pt: cannot write \(No space left on device\)"
    folder = tmp_path / "dump_tensor_data"
    w = writer.TensorWriter(folder)
    for i in range(5):
        assert w.submit(f"T.{i}.pt", tensor)
    with pytest.raises(DumpError, match=expected):
        w.join()
    assert list(tmp_path.iterdir()) == [], "staged files are dropped, never published"


def test_a_writer_refuses_what_does_not_fit_before_writing_it(tmp_path: Path) -> None:
    budget = writer.SizeBudget(2 * writer.file_size_estimate("a.pt", 400))
    w = writer.TensorWriter(tmp_path / "dump_tensor_data", budget=budget)
    assert w.submit("a.pt", torch.ones(100))  # 400 bytes
    assert w.submit("b.pt", torch.ones(100))
    assert not w.submit("c.pt", torch.ones(1))  # the third does not fit, however small
    assert not w.submit("d.pt", torch.ones(1))  # nor anything after it
    assert budget.refused == "c.pt"
    w.join()
    assert sorted(p.name for p in (tmp_path / "dump_tensor_data").iterdir()) == ["a.pt", "b.pt"]
    assert sum(p.stat().st_size for p in (tmp_path / "dump_tensor_data").iterdir()) <= budget.limit
