"""The baseline store: per-test folders, atomic replacement, recovery, manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_msprobe.baseline import MANIFEST_NAME, BaselineStore, Manifest, baseline_folder, read_manifest
from pytest_msprobe.errors import BaselineError


def _manifest(**kw: object) -> Manifest:
    base = dict(
        test="t",
        device="cpu",
        torch="2.x",
        torch_npu=None,
        plugin="0.1.0",
        seed=1234,
        task="statistics",
        level="L1",
        steps=[0],
        created="2026-01-01T00:00:00Z",
        python="3.11",
    )
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def _dump(root: Path, marker: str, steps: tuple[int, ...] = (0, 1)) -> Path:
    for s in steps:
        rank = root / f"step{s}" / "rank"
        rank.mkdir(parents=True)
        (rank / "dump.json").write_text(json.dumps({"task": "statistics", "data": {}, "marker": marker}))
    return root


@pytest.mark.parametrize(
    ("nodeid", "expected"),
    [
        ("tests/test_train.py::test_steps", "tests/test_train/test_steps"),
        ("tests/test_train.py::TestNet::test_steps[cpu-L1]", "tests/test_train/TestNet/test_steps[cpu-L1]"),
        ("test_a.py::test_b[x=1,y=2]", "test_a/test_b[x=1,y=2]"),
    ],
)
def test_folders_are_readable(nodeid: str, expected: str) -> None:
    assert baseline_folder(nodeid).as_posix() == expected


@pytest.mark.parametrize(
    "nodeid", ["a.py::test[../../etc]", "a.py::test[/abs]", "../x.py::t", "a.py::te st[ä]"]
)
def test_hostile_ids_stay_inside_the_root_and_stay_distinct(nodeid: str, tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "root")
    path = store.path_for(nodeid).resolve()
    assert path.is_relative_to((tmp_path / "root").resolve())
    assert all(part not in {"..", "."} for part in baseline_folder(nodeid).parts)
    assert baseline_folder(nodeid) != baseline_folder(nodeid + "x")


def test_write_then_replace_keeps_exactly_the_new_dump(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "baselines")
    nodeid = "tests/test_x.py::test_y"
    assert not store.exists(nodeid)
    final = store.write(nodeid, _dump(tmp_path / "d1", "first"), _manifest())
    assert store.exists(nodeid)
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "first"
    assert read_manifest(final)["seed"] == 1234  # type: ignore[index]

    final2 = store.write(nodeid, _dump(tmp_path / "d2", "second", steps=(0,)), _manifest(seed=7))
    assert final2 == final
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "second"
    assert not (final / "step1").exists(), "files of the old baseline must not survive a rewrite"
    assert read_manifest(final)["seed"] == 7  # type: ignore[index]
    assert (
        sorted(p.name for p in final.parent.iterdir() if p.name.startswith(".") and "lock" not in p.name)
        == []
    )


def test_a_plain_msprobe_dump_without_manifest_is_a_baseline(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    folder = store.path_for("t.py::test_z")
    _dump(folder, "msprobe")
    assert store.exists("t.py::test_z")
    assert read_manifest(folder) is None


def test_nothing_to_store_is_an_error_and_keeps_the_old(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test", _dump(tmp_path / "d1", "old"), _manifest())
    (tmp_path / "empty").mkdir()
    with pytest.raises(BaselineError, match="no step folders"):
        store.write("t.py::test", tmp_path / "empty", _manifest())
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_folder_is_a_clear_error_and_keeps_the_old(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test", _dump(tmp_path / "d1", "old"), _manifest())
    final.parent.chmod(0o555)
    try:
        with pytest.raises(BaselineError, match="previous baseline is unchanged"):
            store.write("t.py::test", _dump(tmp_path / "d2", "new"), _manifest())
    finally:
        final.parent.chmod(0o755)
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"


def test_interrupted_swap_is_recovered(tmp_path: Path) -> None:
    # a writer killed after moving the old baseline aside and before moving the new one in
    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test", _dump(tmp_path / "d1", "old"), _manifest())
    aside = final.parent / f".{final.name}.msprobe-old-deadbeef"
    os.rename(final, aside)
    half = final.parent / f".{final.name}.msprobe-tmp-cafecafe"
    _dump(half, "half-written", steps=(0,))
    assert store.exists("t.py::test")
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"
    assert not aside.exists() and not half.exists()


def test_unreadable_manifest_names_the_file(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(BaselineError, match=MANIFEST_NAME):
        read_manifest(tmp_path)


def test_disk_full_during_copy_is_a_clear_error_and_keeps_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import shutil

    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test", _dump(tmp_path / "d1", "old"), _manifest())
    real_copyfile = shutil.copyfile
    calls = {"n": 0}

    def copy_then_fill_disk(src: str, dst: str, **kw: object) -> object:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return real_copyfile(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "copyfile", copy_then_fill_disk)
    with pytest.raises(BaselineError, match=r"No space left on device.*previous baseline is unchanged"):
        store.write("t.py::test", _dump(tmp_path / "d2", "new"), _manifest())
    monkeypatch.undo()
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"
    assert [p.name for p in final.parent.iterdir() if ".msprobe-" in p.name] == []
