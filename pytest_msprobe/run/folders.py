"""A run's own output folder: claimed under an flock, so that no two runs clear or read each other's files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import uuid
from pathlib import Path

from pytest_msprobe.errors import ConfigError


def claim_folder(base: Path) -> tuple[Path, int | None]:
    """A run's own output folder: ``base`` itself unless another live run holds it (the same test in another
    xdist worker or pytest session), else the first free ``base~2``, ``base~3``...; with the descriptor that
    holds it (an exclusive flock on the folder, released when closed).

    ``~`` never appears in a test's folder name, so no other test's folder can be taken. On a file system
    without flock every run gets a folder named after its process and a random tag.
    """
    for n in range(1, 10_000):
        path = base if n == 1 else base.with_name(f"{base.name}~{n}")
        for _ in range(3):  # the folder may be removed by its previous holder between open and lock
            try:
                path.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                raise ConfigError(
                    f"{path}: cannot create the test's output folder ({exc.strerror or exc})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                break  # held by a live run: try the next name
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                own = base.with_name(f"{base.name}~{os.getpid()}-{uuid.uuid4().hex[:8]}")
                own.mkdir(parents=True)
                return own, None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except OSError:
                same = False
            if same:
                return path, fd
            os.close(fd)
    raise ConfigError(f"{base}: no free output folder for this test")  # pragma: no cover


def clear_folder(folder: Path) -> None:
    """Remove what an earlier run left in ``folder`` (held by this run), keeping the folder."""
    for child in list(folder.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()


def is_inside(path: str, folder: Path) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    except ValueError:
        return False
