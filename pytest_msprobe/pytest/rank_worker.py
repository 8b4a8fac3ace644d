"""The pytest side of multi-rank tests: the command line of a rank process and the plugin it runs.

A rank runs the launcher's own command line (plugins, ini, conftest options) narrowed to the one test:
collection skips what is not on the way to its file, selection options (-k, -m, --lf) cannot drop it, and what
would clash with the launcher is redirected (basetemp, cache, junitxml and html files, xdist, coverage). The
processes themselves are started, watched and reaped by :mod:`pytest_msprobe.run.launcher`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_msprobe.errors import ConfigError, MsprobeError
from pytest_msprobe.run.launcher import SPEC_OPTION, STACK_SIGNAL, RankExit, RankSpec
from pytest_msprobe.run.launcher import launch as launch_ranks

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PR_SET_PDEATHSIG = 1
# the launcher's sys.path goes in before anything is imported: this package and the test's plugins are then
# the ones the launcher uses, whatever PYTHONPATH says
_BOOT = (
    "import json, sys; "
    f"spec = [a for a in sys.argv if a.startswith('{SPEC_OPTION}=')][-1].split('=', 1)[1]; "
    "sys.path[:] = json.load(open(spec, encoding='utf-8'))['sys_path']; "
    "from pytest_msprobe.pytest.rank_worker import rank_main; rank_main()"
)


def rank_command(config: pytest.Config, spec_file: Path, own: Path) -> list[str]:
    """A rank's command line: the launcher's, with what would clash with the launcher redirected into ``own``."""
    args = [sys.executable, "-c", _BOOT, *(str(arg) for arg in config.invocation_params.args)]
    # a rank's prints reach its log as they happen: the tail of a rank that hangs or dies says how far it got
    args += [f"--basetemp={own}", "--capture=no", "--color=no"]
    plugins = config.pluginmanager
    if plugins.hasplugin("cacheprovider"):  # --lf / --sw state stays the launcher's
        args += ["-o", f"cache_dir={own.parent / 'cache'}"]
    if plugins.hasplugin("xdist"):
        args += ["-n", "0", "--dist=no"]
    if plugins.hasplugin("junitxml") and config.getoption("xmlpath", None):
        args.append(f"--junitxml={own}.xml")
    if plugins.hasplugin("html") and config.getoption("htmlpath", None):
        args.append(f"--html={own}.html")
    if plugins.hasplugin("pytest_cov"):  # the rank would write its data over the launcher's
        args.append("--no-cov")
    if plugins.hasplugin("skipping"):  # xfail is the launcher's to judge, from the ranks' real outcomes
        args.append("--runxfail")
    args.append(f"{SPEC_OPTION}={spec_file}")
    return args


def launch(
    item: pytest.Item, world_size: int, backend: str, timeout: float, workdir: Path, dump_dir: Path
) -> list[RankExit]:
    """Run the test's body in ``world_size`` rank processes and return how each ended."""
    config = item.config
    return launch_ranks(
        item.nodeid,
        item.path,
        world_size,
        backend,
        timeout,
        workdir,
        dump_dir,
        lambda spec_file, own: rank_command(config, spec_file, own),
        config.invocation_params.dir,
    )


def _die_with_launcher(launcher_pid: int) -> None:
    """Have the kernel kill this process when the launcher dies (Linux), and leave now if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher_pid:
        os._exit(1)


def rank_main() -> None:
    """A rank process: ``python -c <_BOOT> <the launcher's pytest arguments> --msprobe-rank-spec=FILE``."""
    args = sys.argv[1:]
    prefix = f"{SPEC_OPTION}="
    try:
        spec = RankSpec.read(next(a for a in reversed(args) if a.startswith(prefix))[len(prefix) :])
        rank = int(os.environ["RANK"])
    except (MsprobeError, StopIteration, KeyError, ValueError) as exc:
        sys.stderr.write(f"msprobe rank process: cannot start ({exc!r})\n")
        raise SystemExit(2) from None
    _die_with_launcher(spec.launcher_pid)
    # kept open for the life of the process: where the rank is stuck when the launcher's time is up
    stacks = open(spec.file(rank, ".stack"), "w", encoding="utf-8")  # noqa: SIM115
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    raise SystemExit(pytest.main(args))


class RankProcess:
    """The pytest plugin of a rank process: runs its one test in the process group and reports how it went."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.local_rank = rank  # one node: every rank runs on this machine
        self.world_size = spec.world_size
        self._target = Path(spec.path)
        self._found = False
        self._outcome = self._phase = self._report = ""

    @classmethod
    def from_option(cls, spec_file: str) -> RankProcess:
        spec = RankSpec.read(spec_file)
        try:
            rank = int(os.environ["RANK"])
        except (KeyError, ValueError):
            raise ConfigError(f"{SPEC_OPTION}: this process has no valid RANK in its environment") from None
        if not 0 <= rank < spec.world_size:
            raise ConfigError(f"{SPEC_OPTION}: RANK={rank} is outside world_size {spec.world_size}")
        return cls(spec, rank)

    def join(self, device: torch.device) -> torch.device:
        """Before the body: take this rank's device (``cuda:LOCAL_RANK``) and join the process group."""
        import torch
        import torch.distributed as dist

        if device.type != "cpu":
            device = torch.device(device.type, (device.index or 0) + self.local_rank)
            getattr(torch, device.type).set_device(device)
        timeout = datetime.timedelta(seconds=self.spec.timeout)
        store = dist.TCPStore(self.spec.master_addr, self.spec.master_port, is_master=False, timeout=timeout)
        dist.init_process_group(
            self.spec.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self.spec.file(self.rank, ".ready").touch()  # the launcher's clock starts when every rank is here
        return device

    def leave(self) -> None:
        """After the test: leave the process group (unless the test did)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    @pytest.hookimpl(tryfirst=True)
    def pytest_ignore_collect(self, collection_path: Path) -> bool | None:
        if collection_path == self._target or collection_path in self._target.parents:
            return None
        return True

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Generator[None, None, None]:
        mine = [item for item in items if item.nodeid == self.spec.nodeid]
        yield
        # -k, -m, --lf or --deselect on the launcher's command line may have dropped it: the rank runs it anyway
        items[:] = mine
        self._found = bool(mine)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid != self.spec.nodeid or self._outcome == "failed":
            return
        if report.failed:
            self._outcome, self._phase, self._report = "failed", report.when, report.longreprtext
        elif report.skipped and not self._outcome:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._outcome, self._phase, self._report = "skipped", report.when, reason
        elif report.when == "call" and not self._outcome:
            self._outcome, self._phase = "passed", "call"

    def pytest_sessionfinish(self) -> None:
        result = {
            "found": self._found,
            "outcome": self._outcome,
            "phase": self._phase,
            "report": self._report,
        }
        target = self.spec.file(self.rank, ".json")
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(result), encoding="utf-8")
        os.replace(tmp, target)
