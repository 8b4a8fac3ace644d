"""Files, read and written one way: a JSON file parsed with the project's errors, and atomic writes.

A file written here is either the old file, the complete new one, or absent; a JSON file read here that is
unusable in any way (absent, a folder, empty, not UTF-8, cut short, malformed) raises the caller's error with
the file and the problem.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import ConfigError, DumpFormatError, DumpReadError, PathLike

# error(path, problem) -> the exception to raise
ErrorFactory = Callable[[Path, str], Exception]

# what the system says when it is short of something at that moment (not what the file is: absent, a folder,
# forbidden, damaged): reading it again may well succeed
MACHINE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "EINTR",
        "EAGAIN",
        "ENOMEM",
        "EMFILE",
        "ENFILE",
        "ENOBUFS",
        "EBUSY",
        "ETIMEDOUT",
        "ESTALE",
    )
    if hasattr(errno, name)
)


def unreadable(path: PathLike, exc: OSError, what: str = "cannot read") -> DumpFormatError:
    """The error of a dump's file the system refused to read: :class:`DumpReadError` where the refusal is the
    machine's state at that moment (:data:`MACHINE_ERRNOS`), a plain :class:`DumpFormatError` where it is the
    file's (absent, forbidden, a folder)."""
    problem = f"{what} ({exc.strerror or exc})"
    if exc.errno in MACHINE_ERRNOS:
        return DumpReadError(path, problem)
    return DumpFormatError(path, problem)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def write_text(path: PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically; OSError as the system gives it.

    The temporary file is named after the process and thread (no random name to draw, no chmod: the umask
    applies as it is created); a name already taken, left by a process killed mid-write, falls back to a
    random one.
    """
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".tmp-{name}.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(tmp, _EXCLUSIVE, 0o666)
    except FileExistsError:
        with atomic_path(path) as other, open(other, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    try:
        with open(fd, "wb") as fh:
            fh.write(text.encode("utf-8"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: PathLike, error: ErrorFactory = DumpFormatError) -> Any:
    """Parse a JSON file; every way it can be unusable raises ``error(path, problem)``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except IsADirectoryError:
        raise error(path, "is a folder, not a file") from None
    except OSError as exc:
        if error is DumpFormatError:
            raise unreadable(path, exc) from None
        raise error(path, f"cannot read ({exc.strerror or exc})") from None
    return parse_json(path, raw, error)


def read_sidecar(path: Path, fmt: str, what: str, newest: int) -> dict[str, Any] | None:
    """A JSON file of ours beside a dump (``{"format": fmt, "version": n, ...}``, ``what`` it holds, e.g.
    ``"checklist"``), None when there is none (a plain msprobe dump, or one made without it). One that is there
    but broken, of another format or of a version after ``newest`` raises DumpFormatError naming it."""
    if not path.is_file():
        return None
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        article = "an" if what[:1] in "aeiou" else "a"
        raise DumpFormatError(path, f"not {article} {what} (expected an object with format {fmt!r})")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version > newest:
        raise DumpFormatError(path, f"{what} version {version!r}: this reader knows version {newest}")
    return doc


def parse_json(path: PathLike, raw: bytes, error: ErrorFactory = DumpFormatError) -> Any:
    """Parse the bytes of a JSON file (UTF-8, a byte-order mark allowed), read from ``path``."""
    path = Path(path)
    if not raw.strip():
        raise error(path, "empty file" if not raw else "holds only whitespace, no JSON")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(path, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            # the text stops inside the document: a write that was cut short (killed, disk full)
            raise error(
                path, f"invalid JSON: truncated, the text ends at byte {len(raw)} inside the document"
            ) from None
        raise error(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise error(path, "invalid JSON: nested too deeply to parse") from None
    except ValueError as exc:  # e.g. an integer longer than int() takes
        raise error(path, f"invalid JSON ({exc})") from None


def config_error(path: Path, problem: str) -> Exception:
    """An ``error`` for :func:`read_json` of a settings file: :class:`ConfigError` ``"{path}: {problem}"``."""
    return ConfigError(f"{path}: {problem}")
