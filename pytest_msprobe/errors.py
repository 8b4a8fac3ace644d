"""The project's exceptions, in one place.

Every error a user can cause (a bad option, a broken dump, a missing baseline) is one of these, and its
message names the file or the value and the problem, so the CLI and the pytest plugin can print it as one
line instead of a traceback.
"""

from __future__ import annotations

import os
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


class MsprobeError(Exception):
    """Base class of every error pytest-msprobe raises on purpose."""


class ConfigError(MsprobeError, ValueError):
    """A setting (argument, config.json key, option, ini value, marker keyword) has a bad value."""


class DumpError(MsprobeError):
    """Writing a dump failed (disk full, read-only folder, size limit reached...)."""


class DumpSizeError(DumpError):
    """A dump reached its size limit (``max_dump_size``) and stopped saving tensors."""

    def __init__(self, path: PathLike, limit: str, row: str) -> None:
        self.path = os.fspath(path)
        self.limit = limit  # as people write it, e.g. "500 MB"
        self.row = row  # the first row whose tensor file did not fit
        super().__init__(
            f"{self.path}: the dump reached its {limit} limit at {row}; raise max_dump_size, dump fewer steps "
            "or use task statistics"
        )


class DumpFormatError(MsprobeError):
    """A dump on disk cannot be used: the message names the file and what is wrong with it."""

    def __init__(self, path: PathLike, problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type[DumpFormatError], tuple[str, str]]:
        # (pickled as its own two arguments: it crosses from a compare's worker process whole)
        return type(self), (self.path, self.problem)


class DumpReadError(DumpFormatError):
    """A dump's file is there, but the system did not give its bytes this time (an I/O error, too many open
    files, no memory): the machine's state at that moment, not the dump's. Nothing takes it for the dump's (a
    helper file as absent, a call as not replayable): it stops the compare."""


class BaselineError(MsprobeError):
    """A baseline is missing, incomplete or cannot be written."""


class BaselineMismatchError(BaselineError):
    """A baseline was made by another kind of run than the test now makes (steps, ranks, task, level, seed)."""


class ReportError(MsprobeError):
    """A compare report (xlsx, advisor, summary.json) cannot be written: the message names the file."""
