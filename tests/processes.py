"""The processes a test starts: the arguments of the pytest runs it starts, and what it left behind (Linux
/proc), for the tests of rank launchers."""

from __future__ import annotations

import os
from pathlib import Path

# hypothesis's pytest plugin imports the whole of hypothesis at the end of every session (0.8 s a process); the
# pytest runs the tests start use none of it
NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


def children() -> list[int]:
    """Processes whose parent is this one: a rank left behind would be one."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found
