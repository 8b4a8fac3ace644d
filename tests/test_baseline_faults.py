"""The baseline store under faults: SIGKILL at every stage of a regen, concurrent writers and readers.

Writers run in child processes (the code in ``_CHILD``) that can kill themselves with SIGKILL at a chosen
point of :meth:`BaselineStore.write`, by wrapping the functions it calls; the test then checks every file of
the baseline folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pytest_msprobe.run.baseline import MANIFEST_NAME, BaselineStore, baseline_folder

NODEID = "tests/test_net.py::test_train[lr=0.1]"  # brackets: leftovers must be found without glob patterns
STEPS, FILES, FILE_SIZE = 2, 12, 64 * 1024
ROOT_OF_PROJECT = Path(__file__).resolve().parents[1]

# A writer: ``child.py ROOT VERSION [VERSION...] --kill POINT N --fallback``. Writes the baseline of NODEID once
# per VERSION (from the dump folder ROOT/src-VERSION); with --kill, SIGKILLs itself at the Nth time POINT is
# reached (--pause: waits there until ROOT/go exists); --loop repeats the versions until killed; --fallback turns
# RENAME_EXCHANGE off (a rename pair).
_CHILD = textwrap.dedent(
    """
    import os, shutil, signal, sys, time
    from pathlib import Path
    from pytest_msprobe.run import baseline
    from pytest_msprobe.run.baseline import BaselineStore, Manifest

    args = sys.argv[1:]
    root = Path(args.pop(0))
    point, nth, loop, fallback = None, 0, False, False
    if "--kill" in args:
        i = args.index("--kill")
        point, nth = args[i + 1], int(args[i + 2])
        del args[i : i + 3]
    pause = None
    if "--pause" in args:  # wait at POINT's Nth time, until ROOT/go exists (ROOT/paused says it waits)
        i = args.index("--pause")
        pause, nth = args[i + 1], int(args[i + 2])
        del args[i : i + 3]
    if "--loop" in args:
        args.remove("--loop")
        loop = True
    if "--fallback" in args:
        args.remove("--fallback")
        fallback = True
    versions = args
    calls = {}

    def reached(name):
        calls[name] = calls.get(name, 0) + 1
        if name == point and calls[name] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        if name == pause and calls[name] == nth:
            (root / "paused").touch()
            while not (root / "go").exists():
                time.sleep(0.01)

    real_copyfile, real_exchange, real_rename = shutil.copyfile, baseline._exchange, os.rename
    real_fsync_tree, real_rmtree = baseline._fsync_tree, shutil.rmtree

    def copyfile(src, dst, **kw):
        reached("copy")
        if point == "copy-half" and calls.get("copy", 0) == nth:
            with open(src, "rb") as f, open(dst, "wb") as g:
                g.write(f.read()[: os.path.getsize(src) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_copyfile(src, dst, **kw)

    def exchange(a, b):
        if fallback:
            return False
        reached("exchange-before")
        done = real_exchange(a, b)
        reached("exchange-after")
        return done

    def rename(a, b, **kw):
        reached("rename-before")
        real_rename(a, b, **kw)
        reached("rename-after")

    def fsync_tree(root):
        reached("fsync")
        real_fsync_tree(root)

    def rmtree(path, *a, **kw):
        if baseline._TMP_TAG in str(path) or baseline._OLD_TAG in str(path):
            calls["rmtree"] = calls.get("rmtree", 0) + 1
            if point == "rmtree-half" and calls["rmtree"] == nth:
                real_rmtree(os.path.join(path, "step0"))  # half of the old baseline deleted
                os.kill(os.getpid(), signal.SIGKILL)
        return real_rmtree(path, *a, **kw)

    shutil.copyfile, baseline._exchange, baseline._fsync_tree, shutil.rmtree = copyfile, exchange, fsync_tree, rmtree
    os.rename = rename
    store = BaselineStore(root / "baselines")
    nodeid = os.environ["NODEID"]
    while True:
        for version in versions:
            manifest = Manifest(nodeid, "cpu", "x", None, "x", 1, "tensor", "L1", [0], version, "3", {})
            store.write(nodeid, root / f"src-{version}", manifest)
            print(version, flush=True)
        if not loop:
            break
    """
)


def _make_dump(root: Path, version: str) -> Path:
    """A dump root whose every file says which version it belongs to, and where in it it lies."""
    src = root / f"src-{version}"
    for step in range(STEPS):
        folder = src / f"step{step}" / "rank"
        (folder / "dump_tensor_data").mkdir(parents=True)
        (folder / "dump.json").write_text(json.dumps({"version": version, "step": step}))
        for i in range(FILES):
            head = f"{version}:{step}:{i}:".encode()
            (folder / "dump_tensor_data" / f"T.{i}.pt").write_bytes(head * (FILE_SIZE // len(head)))
    return src


def _version_of(folder: Path) -> str | None:
    """The version a baseline folder holds, None when there is none; fails unless it is complete and whole."""
    if not os.path.lexists(folder):
        return None
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    version = manifest["created"]
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST_NAME, *(f"step{s}" for s in range(STEPS))]
    for step in range(STEPS):
        rank = folder / f"step{step}" / "rank"
        assert json.loads((rank / "dump.json").read_text()) == {"version": version, "step": step}
        files = sorted((rank / "dump_tensor_data").iterdir())
        assert len(files) == FILES, f"{rank}: {len(files)} tensor files"
        for i in range(FILES):
            head = f"{version}:{step}:{i}:".encode()
            data = (rank / "dump_tensor_data" / f"T.{i}.pt").read_bytes()
            assert data == head * (FILE_SIZE // len(head)), f"{rank}/T.{i}.pt is not whole {version}"
    return version


def _leftovers(store: BaselineStore) -> list[str]:
    parent = store.root / baseline_folder(NODEID).parent
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _child(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    if not script.exists():
        script.write_text(_CHILD)
    env = {**os.environ, "NODEID": NODEID, "PYTHONPATH": str(ROOT_OF_PROJECT)}
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="session")
def written_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dumps ``old``, ``new``, ``a`` and ``b``, and a store that a child process wrote ``old`` into: made once,
    since every test that breaks a store starts from this one (a child process costs seconds)."""
    root = tmp_path_factory.mktemp("versions")
    for version in ("old", "new", "a", "b"):
        _make_dump(root, version)
    proc = _child(root, "old")
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    return root


@pytest.fixture
def versions(tmp_path: Path, written_once: Path) -> BaselineStore:
    """Dumps ``old``, ``new``, ``a`` and ``b``; the store holds ``old``. The test's own copy, to break."""
    shutil.copytree(written_once, tmp_path, dirs_exist_ok=True)
    return BaselineStore(tmp_path / "baselines")


KILL_POINTS = [
    # (point, nth, fallback, what the folder holds right after the kill, what it holds once recovered)
    ("copy", 1, False, "old", "old"),
    ("copy", 17, False, "old", "old"),
    ("copy-half", 9, False, "old", "old"),
    ("fsync", 1, False, "old", "old"),
    ("exchange-before", 1, False, "old", "old"),
    ("exchange-after", 1, False, "new", "new"),
    ("rmtree-half", 1, False, "new", "new"),
    ("copy-half", 5, True, "old", "old"),
    ("rename-before", 1, True, "old", "old"),
    ("rename-after", 1, True, None, "old"),  # between the renames: nothing in place until recovered
    ("rename-after", 2, True, "new", "new"),
    ("rmtree-half", 1, True, "new", "new"),
]


@pytest.mark.parametrize(("point", "nth", "fallback", "after_kill", "recovered"), KILL_POINTS)
def test_sigkill_at_each_stage_leaves_one_whole_baseline(
    tmp_path: Path,
    versions: BaselineStore,
    point: str,
    nth: int,
    fallback: bool,
    after_kill: str | None,
    recovered: str,
) -> None:
    store = versions
    folder = store.root / baseline_folder(NODEID)
    proc = _child(tmp_path, "new", "--kill", point, str(nth), *(["--fallback"] if fallback else []))
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    assert _version_of(folder) == after_kill
    assert _leftovers(store), "the kill should have left something to recover"
    assert store.path_for(NODEID) == folder
    assert _version_of(folder) == recovered
    assert _leftovers(store) == []
    # and the next regen goes through
    proc = _child(tmp_path, "a", *(["--fallback"] if fallback else []))
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    assert _version_of(folder) == "a" and _leftovers(store) == []


def test_sigkill_of_a_first_regen_leaves_no_baseline_and_no_leftover(tmp_path: Path) -> None:
    _make_dump(tmp_path, "new")
    store = BaselineStore(tmp_path / "baselines")
    proc = _child(tmp_path, "new", "--kill", "rename-before", "1")
    assert proc.wait(timeout=60) == -signal.SIGKILL
    folder = store.path_for(NODEID)
    assert not folder.exists() and not store.exists(NODEID)
    assert _leftovers(store) == []


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "rename-pair"])
def test_sigkill_at_random_moments_of_repeated_regens(
    tmp_path: Path, versions: BaselineStore, fallback: bool
) -> None:
    store = versions
    folder = store.root / baseline_folder(NODEID)
    rng = random.Random(5)
    seen = set()
    mid_write = 0  # kills that landed inside a write (something left to recover)
    for _ in range(8):
        proc = _child(tmp_path, "a", "b", "--loop", *(["--fallback"] if fallback else []))
        assert proc.stdout is not None
        proc.stdout.readline()  # one regen done: the loop is in full swing
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        if not fallback:  # the exchange leaves no moment without a whole baseline in place
            assert _version_of(folder) in {"a", "b"}
        mid_write += bool(_leftovers(store))
        store.path_for(NODEID)
        seen.add(_version_of(folder))
        assert _leftovers(store) == []
    assert seen <= {"a", "b"}
    assert mid_write >= 4, "the kills should land inside writes"


_READER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from pytest_msprobe.run.baseline import BaselineStore
    sys.path.insert(0, os.environ["TESTS"])
    from test_baseline_faults import _version_of

    store = BaselineStore(Path(sys.argv[1]) / "baselines")
    reads, versions = 0, set()

    def read():
        global reads
        with store.reading(os.environ["NODEID"]) as folder:
            versions.add(_version_of(folder))
        reads += 1

    read()  # the baseline before any writer: then the writers may start
    Path(sys.argv[3]).touch()
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        read()
    read()  # and the one the writers left
    print(json.dumps({"reads": reads, "versions": sorted(versions)}))
    """
)


def test_concurrent_regens_never_interleave_and_a_reader_always_sees_one_whole_baseline(
    tmp_path: Path, versions: BaselineStore
) -> None:
    store = versions
    names = [f"w{w}-{i}" for w in (1, 2) for i in range(10)]
    for name in names:
        _make_dump(tmp_path, name)
    (tmp_path / "reader.py").write_text(_READER)
    done = tmp_path / "writers-done"
    env = {**os.environ, "NODEID": NODEID, "TESTS": str(Path(__file__).parent)}
    env["PYTHONPATH"] = str(ROOT_OF_PROJECT)
    ready = tmp_path / "reader-ready"
    reader = subprocess.Popen(
        [sys.executable, str(tmp_path / "reader.py"), str(tmp_path), str(done), str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120  # (its imports take seconds on a loaded machine)
    while not ready.exists():
        assert reader.poll() is None and time.monotonic() < deadline, (
            reader.stderr.read() if reader.stderr else ""
        )
        time.sleep(0.02)
    writers = [_child(tmp_path, *[n for n in names if n.startswith(w)]) for w in ("w1", "w2")]
    outputs = [w.communicate(timeout=120) for w in writers]
    done.touch()
    out, err = reader.communicate(timeout=120)
    for writer, (_, werr) in zip(writers, outputs):
        assert writer.returncode == 0, werr
    assert reader.returncode == 0, err  # a torn or mixed baseline fails _version_of in the reader
    seen = json.loads(out)
    assert seen["reads"] > 5
    assert len(seen["versions"]) > 1, "the reader should have seen the baseline change"
    assert set(seen["versions"]) <= {"old", *names}
    # each writer wrote its versions in order; the last one written stays, whole
    final = _version_of(store.root / baseline_folder(NODEID))
    assert final in {"w1-9", "w2-9"}
    assert _leftovers(store) == []


@pytest.mark.parametrize(("point", "nth"), [("copy", 5), ("exchange-after", 1), ("rename-after", 1)])
def test_looking_up_a_baseline_never_disturbs_a_writer(
    tmp_path: Path, versions: BaselineStore, point: str, nth: int
) -> None:
    # a lookup while a writer is between two steps must not take its copy or its moved-aside folder for the
    # leftovers of a killed writer
    store = versions
    folder = store.root / baseline_folder(NODEID)
    fallback = ["--fallback"] if point.startswith("rename") else []
    writer = _child(tmp_path, "new", "--pause", point, str(nth), *fallback)
    deadline = time.monotonic() + 60
    while not (tmp_path / "paused").exists():
        assert writer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert store.path_for(NODEID) == folder
    store.exists(NODEID)
    (tmp_path / "go").touch()
    assert writer.wait(timeout=60) == 0, writer.stderr.read() if writer.stderr else ""
    assert _version_of(folder) == "new" and _leftovers(store) == []


def test_a_reader_holds_writers_off_until_it_is_done(tmp_path: Path, versions: BaselineStore) -> None:
    store = versions
    with store.reading(NODEID) as folder:
        writer = _child(tmp_path, "new")
        with pytest.raises(subprocess.TimeoutExpired):
            writer.wait(timeout=1.0)  # blocked on the lock
        assert _version_of(folder) == "old"
    assert writer.wait(timeout=60) == 0
    assert _version_of(folder) == "new"
