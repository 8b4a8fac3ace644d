"""The baseline store: one msprobe-format dump folder per test, written atomically, with a manifest.

Layout under the baseline root (``--msprobe-baseline``)::

    <root>/<test file without .py>/<test name>[<params>]/
        step0/rank/dump.json, stack.json, construct.json [, dump_tensor_data/]
        step1/...
        msprobe_manifest.json        how the baseline was made (ours; msprobe's files are never changed)

Any msprobe dump root (a folder holding ``step{N}/``), such as one written by plain msprobe on a GPU, can be
dropped in as a test's folder; the manifest is optional.

Writing is all-or-nothing: the new baseline is assembled in a hidden sibling folder and then swapped in with one
atomic ``renameat2(RENAME_EXCHANGE)`` where Linux offers it (a rename pair otherwise, with the old folder kept
until the new one is in place and recovered on the next run if the process died in between). A writer killed at
any moment (SIGKILL included) leaves the old baseline whole or the new one complete, plus hidden leftovers that
the next :meth:`BaselineStore.path_for` or :meth:`BaselineStore.write` removes.

Writers of a baseline hold an exclusive ``flock`` on its parent folder, readers (:meth:`BaselineStore.reading`) a
shared one: two CI jobs cannot interleave files, and a compare never reads half of one baseline and half of the
next. The lock is on the folder itself, so no lock file is left among the baselines.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import difflib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import BaselineError, ConfigError
from pytest_msprobe.format.files import read_json
from pytest_msprobe.format.layout import STEP_DIR
from pytest_msprobe.options import REGEN

MANIFEST_NAME = "msprobe_manifest.json"
_SAFE = re.compile(r"[^A-Za-z0-9._\-\[\]=+,@]")
_MAX_PART = 100
_TMP_TAG = ".msprobe-tmp-"
_OLD_TAG = ".msprobe-old-"


@dataclass(frozen=True)
class Manifest:
    """How a baseline was made: enough to tell why two devices' numbers might differ."""

    test: str
    device: str
    torch: str
    torch_npu: str | None
    plugin: str
    seed: int
    task: str
    level: str
    steps: list[int]
    created: str
    python: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def _safe_part(part: str) -> str:
    cleaned = _SAFE.sub("_", part)[:_MAX_PART]
    if cleaned != part or cleaned in {"", ".", ".."} or cleaned.startswith("."):
        digest = hashlib.sha1(part.encode()).hexdigest()[:8]
        cleaned = f"{cleaned.lstrip('.') or 'test'}-{digest}"
    return cleaned


def baseline_folder(nodeid: str) -> Path:
    """The relative folder of a test's baseline: readable, stable across machines, safe as a path.

    ``tests/test_train.py::TestNet::test_steps[cpu]`` -> ``tests/test_train/TestNet/test_steps[cpu]``.
    Characters outside a conservative set are replaced and the part gets a short hash, so two ids never share
    a folder and no id can climb out of the baseline root.
    """
    path_part, *names = nodeid.split("::")
    file_parts = [p for p in path_part.replace("\\", "/").split("/") if p]
    if file_parts and file_parts[-1].endswith(".py"):
        file_parts[-1] = file_parts[-1][: -len(".py")]
    parts = [_safe_part(p) for p in (*file_parts, *names)]
    if not parts:
        raise BaselineError(f"cannot derive a baseline folder from test id {nodeid!r}")
    return Path(*parts)


def is_dump_root(path: Path) -> bool:
    """True when ``path`` holds at least one ``step{N}`` folder (an msprobe dump root)."""
    try:
        return any(STEP_DIR.match(p.name) and p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def root_holding(root: Path, nodeid: str, limit: int = 200) -> Path | None:
    """Another baseline root near ``root`` under which the test ``nodeid`` has its baseline, or None.

    A root given one level too deep (``baselines/cpu/examples`` for ``baselines/cpu``) or too high (``baselines``
    for ``baselines/cpu``) makes every test miss its baseline while it sits a folder away: the folders above
    ``root`` and the folders just inside it (at most ``limit`` of them) are tried in that order.
    """
    rel = baseline_folder(nodeid)
    root = Path(os.path.abspath(root))
    for above in root.parents:
        if is_dump_root(above / rel):
            return above
    try:
        inside = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))[:limit]
    except OSError:
        return None
    return next((folder for folder in inside if is_dump_root(folder / rel)), None)


def dump_root_above(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` (links followed) that is a dump root, a baseline's or a dump's;
    None when there is none: what is written there must not be written into a baseline."""
    real = Path(os.path.realpath(path))
    return next((folder for folder in (real, *real.parents) if is_dump_root(folder)), None)


def _names_a_test(relative: Path, rootdir: Path) -> bool:
    """Whether ``relative`` reads as a test's baseline folder: a test file under ``rootdir`` (``.py`` dropped),
    then at least one name within it (see :func:`baseline_folder`)."""
    parts = relative.parts
    return any(
        rootdir.joinpath(*parts[: k - 1], parts[k - 1] + ".py").is_file() for k in range(1, len(parts))
    )


def check_baseline_root(root: Path, rootdir: Path, compare: bool) -> str | None:
    """Refuse, before any test trains, a baseline root that cannot be the one meant: one test's own baseline
    folder (each test's folder would be looked for, or written, inside it), or, when comparing, a folder that
    does not exist where a sibling has a close name or its parent is missing too (a mistyped path: every test
    would train and then miss its baseline). A new folder beside existing ones is left to the tests, each of
    which reports its missing baseline with the command that writes it; for it this returns the line that
    says so before any test trains (None for a root that exists). ``rootdir`` is where test ids start.
    """
    root = Path(os.path.abspath(root))
    held = [name for name in ("step0", MANIFEST_NAME, "dump.json") if (root / name).exists()]
    if is_dump_root(root) or held:
        above = next((a for a in root.parents if _names_a_test(root.relative_to(a), rootdir)), root.parent)
        what = ", ".join(held) if held else "step folders"
        raise ConfigError(
            f"the baseline folder {root} is one test's own baseline (it holds {what}), so every test's folder "
            f"would be looked for inside it: give the folder that holds all the tests' baselines, {above}?"
        )
    if not compare or root.exists():
        return None
    existing = next(a for a in root.parents if a.is_dir())
    first, *rest = root.relative_to(existing).parts
    try:
        siblings = sorted(p.name for p in existing.iterdir() if p.is_dir())
    except OSError:
        siblings = []
    close = difflib.get_close_matches(first, siblings, n=1, cutoff=0.8)
    if close:
        hint = f"did you mean {existing.joinpath(close[0], *rest)}?"
    elif existing != root.parent:
        hint = f"the nearest folder that exists is {existing}"
    else:
        return (
            f"the baseline folder {root} does not exist (beside it: {_some(siblings)}): every msprobe test "
            f"will report its baseline missing; to write them there, add {REGEN.flag}"
        )
    raise ConfigError(
        f"the baseline folder {root} does not exist; {hint} (to write new baselines there, add {REGEN.flag})"
    )


def _some(names: list[str], most: int = 5) -> str:
    if not names:
        return "no folder"
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a baseline folder, or None when it has none (a plain msprobe dump)."""
    file = path / MANIFEST_NAME
    if not file.is_file():
        return None
    data = read_json(file, lambda path, why: BaselineError(f"{path}: unreadable baseline manifest ({why})"))
    if not isinstance(data, dict):
        raise BaselineError(f"{file}: baseline manifest is not a JSON object")
    return data


def _renameat2_exchange() -> Any:
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2_exchange()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False when the system cannot."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder of ``root``: the swap must never publish names whose data are not on disk."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _copy_tree(src: Path, dst: Path) -> None:
    """copytree, raising the first file's OSError itself (copytree gathers them into one flattened text)."""
    failures: list[OSError] = []

    def copy(source: str, target: str) -> Any:
        try:
            return shutil.copy2(source, target)
        except OSError as exc:
            failures.append(exc)
            raise

    try:
        shutil.copytree(src, dst, copy_function=copy)
    except shutil.Error as exc:
        if failures:
            raise failures[0] from exc
        raise


def _full_file_system(folder: Path) -> str:
    """Which file system holding ``folder`` is full, and what it has left: '... mounted at /data is full, 0 B
    free'."""
    from pytest_msprobe.settings import format_size

    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    mount = probe
    try:
        device = os.stat(probe).st_dev
        while mount.parent != mount and os.stat(mount.parent).st_dev == device:
            mount = mount.parent
        free = f", {format_size(shutil.disk_usage(probe).free)} free"
    except OSError:
        free = ""
    return f"the file system mounted at {mount} is full{free}"


def _lock_fd(folder: Path) -> int | None:
    """A descriptor of ``folder`` to flock, or None when there is no such folder to open."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # missing, not a folder, unreadable: nothing stored there to protect
        return None


class BaselineStore:
    """Locate, check and (re)write per-test baselines under one root folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _final(self, nodeid: str) -> Path:
        """Where the test's baseline lives: its folder under the root, or where that folder links to.

        A linked folder is followed, so that the baseline is written in place (atomically, beside the link's
        target) and the link stays; swapping the link itself would replace it with a copy.
        """
        path = self.root / baseline_folder(nodeid)
        if not os.path.islink(path):
            return path
        target = Path(os.path.realpath(path))
        if os.path.islink(target):
            raise BaselineError(
                f"{path}: the baseline folder is a symbolic link that cannot be followed (a loop?)"
            )
        return target

    def path_for(self, nodeid: str) -> Path:
        """The test's baseline folder (which may not exist), after removing what a killed writer left; a
        folder that is a symbolic link is its target."""
        path = self._final(nodeid)
        fd = _lock_fd(path.parent)
        if fd is not None:
            try:
                # never wait, never touch a folder in use: a writer holding the lock recovers by itself
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass
            else:
                self._recover(path)
            finally:
                os.close(fd)  # closing releases the lock
        return path

    def exists(self, nodeid: str) -> bool:
        return is_dump_root(self.path_for(nodeid))

    @contextlib.contextmanager
    def reading(self, nodeid: str) -> Iterator[Path]:
        """The test's baseline folder, kept from being replaced while the block reads it.

        Example::

            with store.reading(nodeid) as folder:
                result = compare(dump, folder)      # never half of one baseline and half of the next
        """
        path = self.path_for(nodeid)
        fd = _lock_fd(path.parent)
        try:
            if fd is not None:
                # a file system without flock (some network mounts) reads unlocked rather than not at all
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_SH)
            yield path
        finally:
            if fd is not None:
                os.close(fd)

    @contextlib.contextmanager
    def _locked(self, final: Path) -> Iterator[None]:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _leftovers(final: Path, tag: str) -> list[Path]:
        # listed, not globbed: test names hold [ ] that glob would read as a pattern
        prefix = f".{final.name}{tag}"
        try:
            names = sorted(n for n in os.listdir(final.parent) if n.startswith(prefix))
        except OSError:
            return []
        return [final.parent / n for n in names]

    def _recover(self, final: Path) -> None:
        """Undo what a killed writer left (the caller holds the lock): put a moved-aside baseline back, drop copies.

        A writer killed between its two renames (the fallback without RENAME_EXCHANGE) left no baseline in place
        and the old one aside: the old one comes back, not the new copy, whose completeness nothing records.
        """
        olds = self._leftovers(final, _OLD_TAG)
        if olds and not os.path.lexists(final):
            with contextlib.suppress(OSError):
                os.rename(olds[-1], final)
                olds = olds[:-1]
        for leftover in (*olds, *self._leftovers(final, _TMP_TAG)):
            shutil.rmtree(leftover, ignore_errors=True)

    def write(self, nodeid: str, dump_root: Path, manifest: Manifest) -> Path:
        """Replace the test's baseline with a copy of ``dump_root`` plus a manifest, all or nothing."""
        if not is_dump_root(dump_root):
            raise BaselineError(f"{dump_root}: no step folders to store as a baseline (was anything dumped?)")
        final = self._final(nodeid)
        had_one = False
        try:
            with self._locked(final):
                self._recover(final)
                had_one = is_dump_root(final)
                tmp = final.parent / f".{final.name}{_TMP_TAG}{uuid.uuid4().hex[:8]}"
                try:
                    _copy_tree(dump_root, tmp)
                    (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
                    _fsync_tree(tmp)
                    self._swap(tmp, final)
                    with contextlib.suppress(OSError):  # in place already: only durability is at stake
                        _fsync_path(final.parent)
                finally:
                    if tmp.exists():
                        shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            where, why = exc.filename or final, exc.strerror or str(exc)
            if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
                _src, where, why = exc.args[0][0]  # a folder's error gathered by copytree: report the first
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the copy may name its source: say what is full
                where = f"{final.parent}: {_full_file_system(final.parent)}"
            at = "" if os.fspath(where) == os.fspath(final) else f" at {where}"
            kept = "the previous baseline is unchanged" if had_one else "no baseline was written"
            raise BaselineError(f"{final}: cannot write the baseline ({why}{at}); {kept}") from exc
        return final

    @staticmethod
    def _swap(tmp: Path, final: Path) -> None:
        """Put the complete copy ``tmp`` in place of ``final``; ``tmp`` holds what is left to delete afterwards."""
        if not final.exists():
            os.rename(tmp, final)
        elif _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # holds the old baseline now
        else:
            old = final.parent / f".{final.name}{_OLD_TAG}{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)  # keep the promise of the error message: the old one in place
                raise
            shutil.rmtree(old, ignore_errors=True)
