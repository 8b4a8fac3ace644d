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
until the new one is in place and recovered on the next run if the process died in between). Concurrent writers
of the same baseline are serialised by a lock on their folder, so two CI jobs cannot interleave files.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
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

from pytest_msprobe.errors import BaselineError

MANIFEST_NAME = "msprobe_manifest.json"
_STEP_DIR = re.compile(r"^step\d+$")
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
        return any(_STEP_DIR.match(p.name) and p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a baseline folder, or None when it has none (a plain msprobe dump)."""
    file = path / MANIFEST_NAME
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BaselineError(f"{file}: unreadable baseline manifest ({exc})") from exc
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


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class BaselineStore:
    """Locate, check and (re)write per-test baselines under one root folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path_for(self, nodeid: str) -> Path:
        path = self.root / baseline_folder(nodeid)
        self._recover(path)
        return path

    def exists(self, nodeid: str) -> bool:
        return is_dump_root(self.path_for(nodeid))

    @contextlib.contextmanager
    def _locked(self, final: Path) -> Iterator[None]:
        # an flock on the parent folder itself: no lock file is left among the baselines
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _recover(self, final: Path) -> None:
        """Undo what a writer killed between its two renames left: put the old baseline back."""
        parent = final.parent
        if not parent.is_dir():
            return
        olds = sorted(parent.glob(f".{final.name}{_OLD_TAG}*"))
        if olds and not final.exists():
            with contextlib.suppress(OSError):
                os.rename(olds[-1], final)
                olds = olds[:-1]
        for leftover in (*olds, *parent.glob(f".{final.name}{_TMP_TAG}*")):
            shutil.rmtree(leftover, ignore_errors=True)

    def write(self, nodeid: str, dump_root: Path, manifest: Manifest) -> Path:
        """Replace the test's baseline with a copy of ``dump_root`` plus a manifest, all or nothing."""
        if not is_dump_root(dump_root):
            raise BaselineError(f"{dump_root}: no step folders to store as a baseline (was anything dumped?)")
        final = self.root / baseline_folder(nodeid)
        try:
            with self._locked(final):
                self._recover(final)
                tmp = final.parent / f".{final.name}{_TMP_TAG}{uuid.uuid4().hex[:8]}"
                try:
                    shutil.copytree(dump_root, tmp)
                    (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
                    _fsync_tree(tmp)
                    if final.exists():
                        if _exchange(tmp, final):
                            shutil.rmtree(tmp, ignore_errors=True)  # holds the old baseline now
                        else:
                            old = final.parent / f".{final.name}{_OLD_TAG}{uuid.uuid4().hex[:8]}"
                            os.rename(final, old)
                            os.rename(tmp, final)
                            shutil.rmtree(old, ignore_errors=True)
                    else:
                        os.rename(tmp, final)
                finally:
                    if tmp.exists():
                        shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            where, why = exc.filename or final, exc.strerror or str(exc)
            if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
                _src, where, why = exc.args[0][0]  # copytree gathers per-file errors: report the first
            raise BaselineError(
                f"{where}: cannot write the baseline ({why}); the previous baseline is unchanged"
            ) from exc
        return final
