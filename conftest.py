"""Repository-level pytest configuration (each test folder keeps its own fixtures in its conftest.py).

The whole suite, run as the README says (a bare `pytest`, tests from testpaths), runs on every core with
pytest-xdist; a run naming its tests (`pytest tests/plugin/test_trend.py`) stays in one process, and `-n 0` or
`-p no:xdist` keeps any run there (for --pdb, print debugging). `pytest -m "not slow"` leaves out the tests that
take about 10 s or more (marked `slow`) for a quick loop; CI runs them all.

Two guards for the whole suite, so that one broken test stays one failure:

- after each test, whatever it left of a dump (a started debugger, API wrappers, gradients switched off) is
  cleaned up and reported as that test's error, instead of failing every later test that starts a debugger;
- once the session is over, a watchdog prints every thread's stack and ends the process if it has not exited
  within a few minutes (a thread that never finishes would otherwise hold the run until CI's time runs out);
  under xdist it watches the controller, which ends its workers itself.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Iterator

import pytest

# the plugin's whole-workflow tests drive real pytest runs
pytest_plugins = ["pytester"]

EXIT_GRACE_S = 300.0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A bare `pytest` gets `-n auto --dist worksteal`, so that every core of CI's machine runs tests. Runs
    before xdist's own hook (registered later, called first), so xdist turns it into workers as if it had been
    typed. Work stealing: a worker that has run its share takes tests still waiting for the others, so the run
    does not end on one worker working through the long tests it was dealt at the start."""
    if (
        config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and config.pluginmanager.hasplugin("xdist")
        and not hasattr(config, "workerinput")
        and config.option.numprocesses is None
        and not config.option.tx
    ):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "worksteal"


def _dump_leftovers() -> list[str]:
    """Clean up what a test left of a dump in this process; returns what was found."""
    if "pytest_msprobe.dump.debugger" not in sys.modules:
        return []  # nothing was ever started
    import torch

    from pytest_msprobe.dump import debugger, intercept, threads

    found = []
    for ident, started in list(debugger._STARTED.items()):
        found.append(f"a PrecisionDebugger left started (thread {ident})")
        try:
            started.abort()
            started.close()
        except BaseException as exc:  # reported below; the cleanup goes on
            found.append(f"closing it raised {type(exc).__name__}: {exc}")
        debugger._STARTED.pop(ident, None)
    if threads.slot.active is not None:
        found.append("a recorder left active")
        threads.slot.active = None
    if intercept.wrappers_installed():
        found.append("API wrappers left installed")
    if not torch.is_grad_enabled():
        found.append("gradients left switched off")
        torch.set_grad_enabled(True)
    return found


@pytest.fixture(autouse=True)
def _one_test_leaks_into_no_other() -> Iterator[None]:
    yield
    found = _dump_leftovers()
    if found:
        pytest.fail("the test left dump state behind (cleaned up now): " + "; ".join(found), pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the order that deals the long tests out evenly. Work stealing hands each worker a run of
    consecutive tests at the start (the first run to the first worker, and so on), so the modules holding slow
    tests (each module kept whole, in its own order) are shared out among those runs, each to the run with the
    fewest slow tests so far; each run begins with its share, and the other tests fill the runs up in their
    order. The long tests start early on every worker, and stealing evens out the rest. Every worker sorts
    alike, as xdist needs; a run in one process keeps its order."""
    if not hasattr(config, "workerinput"):
        return
    workers = max(1, int(config.workerinput.get("workercount", 1)))
    modules: dict[object, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    weight = {
        path: sum(i.get_closest_marker("slow") is not None for i in group) for path, group in modules.items()
    }
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for path, group in modules.items():
        if weight[path]:
            least = loads.index(min(loads))
            shares[least] += group
            loads[least] += weight[path]
    rest = [item for path, group in modules.items() if not weight[path] for item in group]
    ordered: list[pytest.Item] = []
    for w, share in enumerate(shares):  # xdist's first split: what is left, divided by the workers left
        size = (len(items) - len(ordered)) // (workers - w)
        take = max(0, size - len(share))
        ordered += share + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # an xdist worker that has run its share waits for the controller, which ends it (and kills it if it
        # hangs): a watchdog here would kill a worker whose session ended while the others still run
        return

    def watch() -> None:
        threading.Event().wait(EXIT_GRACE_S)
        sys.stderr.write(f"\nthe test process has not exited {EXIT_GRACE_S:.0f} s after the session ended:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=watch, name="exit-watchdog", daemon=True).start()
