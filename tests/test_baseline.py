"""The baseline store: per-test folders, atomic replacement, recovery, manifests."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_msprobe.errors import BaselineError
from pytest_msprobe.run.baseline import MANIFEST_NAME, BaselineStore, Manifest, baseline_folder, read_manifest


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


@pytest.mark.parametrize("nodeid", ["t.py::test", "t.py::test[lr=0.1-*?]"])
def test_interrupted_swap_is_recovered(tmp_path: Path, nodeid: str) -> None:
    # a writer killed after moving the old baseline aside and before moving the new one in
    store = BaselineStore(tmp_path / "b")
    final = store.write(nodeid, _dump(tmp_path / "d1", "old"), _manifest())
    aside = final.parent / f".{final.name}.msprobe-old-deadbeef"
    os.rename(final, aside)
    half = final.parent / f".{final.name}.msprobe-tmp-cafecafe"
    _dump(half, "half-written", steps=(0,))
    assert store.exists(nodeid)
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


def _refuse(err: int, under: Path, real: Callable[..., Any], writes_only: bool = False) -> Callable[..., Any]:
    """``real``, failing with ``err`` on paths under ``under``, as a read-only or full file system does."""

    def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
        mode = args[0] if args else kwargs.get("mode", "r")
        writing = not writes_only or (isinstance(mode, str) and any(c in mode for c in "wax+"))
        if writing and Path(os.fspath(path)).resolve().is_relative_to(under.resolve()):
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real(path, *args, **kwargs)

    return fake


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.ENOSPC], ids=["EROFS", "EACCES", "ENOSPC"])
@pytest.mark.parametrize("where", ["copy-folder", "copy-file", "manifest", "swap", "fallback-second-rename"])
def test_a_refused_write_at_any_stage_names_the_path_and_keeps_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, where: str
) -> None:
    import shutil

    from pytest_msprobe.run import baseline

    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test[x]", _dump(tmp_path / "d1", "old"), _manifest())
    new_dump = _dump(tmp_path / "d2", "new")
    parent = final.parent
    if where == "copy-folder":  # the copy's folder cannot be made (what a read-only folder refuses first)
        monkeypatch.setattr(os, "mkdir", _refuse(err, parent, os.mkdir))
    elif where == "copy-file":
        monkeypatch.setattr(shutil, "open", _refuse(err, parent, open, writes_only=True), raising=False)
    elif where == "manifest":
        monkeypatch.setattr(Path, "write_text", _refuse(err, parent, Path.write_text))
    elif where == "swap":
        monkeypatch.setattr(baseline, "_exchange", _refuse(err, parent, baseline._exchange))
    else:
        monkeypatch.setattr(baseline, "_exchange", lambda a, b: False)
        real_rename = os.rename
        monkeypatch.setattr(
            os,
            "rename",
            lambda a, b: (
                real_rename(a, b)
                if ".msprobe-tmp-" not in str(a)
                else _refuse(err, parent, real_rename)(a, b)
            ),
        )
    with pytest.raises(BaselineError) as info:
        store.write("t.py::test[x]", new_dump, _manifest())
    monkeypatch.undo()
    message = str(info.value)
    assert message.startswith(f"{final}: cannot write the baseline ({os.strerror(err)}")
    assert message.endswith("; the previous baseline is unchanged")
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"
    assert read_manifest(final) is not None
    assert [p.name for p in parent.iterdir() if ".msprobe-" in p.name] == []


def test_a_read_only_root_refuses_a_first_baseline_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "b"
    root.mkdir()
    monkeypatch.setattr(os, "mkdir", _refuse(errno.EROFS, root, os.mkdir))
    with pytest.raises(BaselineError) as info:
        BaselineStore(root).write("t.py::test", _dump(tmp_path / "d1", "new"), _manifest())
    monkeypatch.undo()
    assert str(info.value) == (
        f"{root / 't' / 'test'}: cannot write the baseline (Read-only file system at {root / 't'}); "
        "no baseline was written"
    )
    assert list(root.iterdir()) == []


def test_a_full_disk_is_named_by_the_baseline_folder_and_its_file_system_not_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    store = BaselineStore(tmp_path / "b")
    final = store.write("t.py::test", _dump(tmp_path / "d1", "old"), _manifest())
    source = _dump(tmp_path / "d2", "new")

    def copy_on_a_full_disk(src: str, dst: str, **kw: object) -> object:
        # what shutil's sendfile copy raises: the error carries the source file's name
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)

    monkeypatch.setattr(shutil, "copyfile", copy_on_a_full_disk)
    with pytest.raises(BaselineError) as info:
        store.write("t.py::test", source, _manifest())
    monkeypatch.undo()
    message = str(info.value)
    assert str(source) not in message
    mount = Path(tmp_path)
    while mount.parent != mount and os.stat(mount.parent).st_dev == os.stat(tmp_path).st_dev:
        mount = mount.parent
    assert message.startswith(
        f"{final}: cannot write the baseline (No space left on device at {final.parent}: the file system "
        f"mounted at {mount} is full, "
    )
    assert message.endswith(" free); the previous baseline is unchanged")
    assert json.loads((final / "step0/rank/dump.json").read_text())["marker"] == "old"


@pytest.mark.parametrize("kind", ["existing", "dangling"])
def test_a_linked_baseline_folder_is_written_where_it_points_and_the_link_stays(
    tmp_path: Path, kind: str
) -> None:
    store = BaselineStore(tmp_path / "b")
    link = tmp_path / "b" / "t" / "test"
    link.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere" / "test"
    if kind == "existing":
        store_elsewhere = BaselineStore(tmp_path / "x")
        old = store_elsewhere.write("t.py::test", _dump(tmp_path / "d0", "old"), _manifest())
        target = old
    os.symlink(target, link)
    for marker in ("new", "newer"):
        written = store.write("t.py::test", _dump(tmp_path / f"d-{marker}", marker), _manifest())
        assert written == target and os.path.islink(link) and os.readlink(link) == str(target)
        assert json.loads((link / "step0/rank/dump.json").read_text())["marker"] == marker
        assert [p.name for p in link.parent.iterdir()] == ["test"], "nothing hidden left beside the link"
        assert [p.name for p in target.parent.iterdir()] == [target.name], "nothing left beside the target"
    assert store.path_for("t.py::test") == target


def test_a_baseline_folder_that_is_a_link_loop_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "b" / "t" / "test"
    link.parent.mkdir(parents=True)
    os.symlink(link, link)
    with pytest.raises(BaselineError, match="symbolic link that cannot be followed"):
        BaselineStore(tmp_path / "b").write("t.py::test", _dump(tmp_path / "d", "x"), _manifest())
