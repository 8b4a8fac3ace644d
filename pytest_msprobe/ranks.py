"""Multi-rank tests: the body of a test marked ``world_size=N`` runs in N rank processes, torchrun-style.

The pytest process that collected the test (the launcher) does not run the body. It starts N child pytest
processes on the same test, each told its part by the hidden option ``--msprobe-rank-spec`` and the environment
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank joins the
process group through a TCPStore that the launcher holds (its port is bound before any rank needs it, so no two
tests or xdist workers can share one), runs the fixture and the body, and dumps ``step{N}/rank{R}/`` into the
test's dump folder; the launcher then compares all ranks at once. The first rank that fails or dies stops the
others; ranks still running when the time is up write their Python stacks and are stopped. Every rank is reaped
on every path (a failure, the timeout, Ctrl-C), and a rank whose launcher dies is killed by the kernel.

A rank runs the launcher's own command line (plugins, ini, conftest options) narrowed to the one test:
collection skips what is not on the way to its file, selection options (-k, -m, --lf) cannot drop it, and what
would clash with the launcher is redirected (basetemp, cache, junitxml and html files, xdist, coverage).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_msprobe.errors import ConfigError, MsprobeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

SPEC_OPTION = "--msprobe-rank-spec"
DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
MASTER_ADDR = "127.0.0.1"
STACK_SIGNAL = signal.SIGUSR1  # asks a rank for its Python stacks (faulthandler) before it is killed
_STACK_GRACE = 0.5  # seconds for the stacks to be written: faulthandler writes from the signal handler itself
_POLL = 0.05
_OUTPUT_LIMIT = 1 << 20  # bytes of a rank's output kept for the test report
# the launcher's sys.path goes in before anything is imported: this package and the test's plugins are then
# the ones the launcher uses, whatever PYTHONPATH says
_BOOT = (
    "import json, sys; "
    f"spec = [a for a in sys.argv if a.startswith('{SPEC_OPTION}=')][-1].split('=', 1)[1]; "
    "sys.path[:] = json.load(open(spec, encoding='utf-8'))['sys_path']; "
    "from pytest_msprobe.ranks import rank_main; rank_main()"
)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    """What the launcher tells its ranks; a JSON file in the launch's work folder (the rank is in RANK)."""

    nodeid: str
    path: str  # the test's file: a rank collects nothing that is not on the way to it
    world_size: int
    backend: str
    master_addr: str
    master_port: int
    timeout: float
    workdir: str  # rank{R}.log (output), rank{R}.json (result), rank{R}.stack, rank{R}/ (basetemp)
    dump_dir: str  # where every rank dumps: step{N}/rank{R}/ (the launcher compares the whole folder)
    sys_path: tuple[str, ...]  # the launcher's: rootdir and conftest folders, -p plugins on a test's own path
    launcher_pid: int

    def file(self, rank: int, suffix: str) -> Path:
        return Path(self.workdir) / f"rank{rank}{suffix}"

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> RankSpec:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(**{**data, "sys_path": tuple(data["sys_path"])})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{path}: unusable rank spec ({exc})") from None


# ------------------------------------------------------------------------------------------------ launcher


def check_launch(world_size: int, backend: str | None, device: torch.device, where: str) -> str:
    """The backend the ranks of a test will use (by device when not given); ConfigError when they cannot start."""
    import torch
    import torch.distributed as dist

    if os.name != "posix":
        raise ConfigError(f"{where}: world_size={world_size} needs a POSIX system (process groups, signals)")
    if not dist.is_available():
        raise ConfigError(f"{where}: world_size={world_size} needs torch.distributed, which this torch lacks")
    name = backend or DEFAULT_BACKENDS.get(device.type, "gloo")
    if not dist.is_backend_available(name):
        raise ConfigError(
            f"{where}: torch.distributed backend {name!r} is not available here (device {device}); "
            "choose another with the marker's backend="
        )
    if device.type != "cpu":
        count = int(getattr(torch, device.type).device_count())
        first = device.index or 0
        if first + world_size > count:
            raise ConfigError(
                f"{where}: world_size={world_size} needs {device.type} devices {first} to "
                f"{first + world_size - 1}, {count} visible"
            )
    return name


@dataclass(frozen=True)
class ProcessEnd:
    """How one process of a group ended."""

    status: int  # exit status; -N: killed by signal N
    order: int  # 0 for the first to end by itself, 1 for the next...; -1: stopped by us
    timed_out: bool  # still running when the time was up


def _poll_exit(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status of a process that has ended, None while it runs, leaving it unreaped: its pid, and so
    its process group id, cannot be given to another process before we kill the group and reap it."""
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict[str, str]],
    cwd: str | os.PathLike[str],
    logs: Sequence[Path],
    timeout: float,
) -> list[ProcessEnd]:
    """Run the commands side by side until all have ended, one has failed (a non-zero status: the others are
    stopped) or ``timeout`` seconds have passed (those still running get STACK_SIGNAL, then are stopped).

    Each runs in a session of its own (a terminal's Ctrl-C reaches only us) with stdout and stderr appended to
    its log; stopping one kills its process group. Every process is reaped before this returns or raises.
    """
    procs: list[subprocess.Popen[bytes]] = []
    ended: dict[int, tuple[int, int]] = {}  # index -> (status, order)
    late: set[int] = set()
    try:
        for command, env, log in zip(commands, envs, logs):
            with open(log, "ab") as out:
                procs.append(
                    subprocess.Popen(
                        list(command),
                        cwd=cwd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            for i, proc in enumerate(procs):
                if i not in ended and (status := _poll_exit(proc)) is not None:
                    ended[i] = (status, len(ended))
            if len(ended) == len(procs) or any(status != 0 for status, _ in ended.values()):
                break
            if time.monotonic() >= deadline:
                late = {i for i in range(len(procs)) if i not in ended}
                for i in late:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[i].pid, STACK_SIGNAL)
                time.sleep(_STACK_GRACE)
                break
            time.sleep(_POLL)
    finally:
        for proc in procs:  # the ended ones too: what they started may still run in their group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    return [
        ProcessEnd(ended[i][0], ended[i][1], False)
        if i in ended
        else ProcessEnd(proc.returncode, -1, i in late)
        for i, proc in enumerate(procs)
    ]


@dataclass(frozen=True)
class RankExit:
    """How one rank process ended and what it reported about its test."""

    rank: int
    status: int  # exit status; -N: killed by signal N
    stopped: bool  # killed by the launcher: another rank failed first, or the time was up
    timed_out: bool  # still running when the time was up
    order: int  # among the ranks that ended by themselves, 0 first; -1 when stopped
    found: bool  # the rank collected the test
    outcome: str  # "passed", "failed", "skipped", or "" when the rank reported nothing
    phase: str  # setup, call or teardown: where it failed or skipped
    report: str  # the failure's report, the skip's reason
    output: str  # what the rank wrote to stdout and stderr (the end of it)
    stack: str  # its Python stacks when it was stopped at the timeout


def _read_tail(path: Path, limit: int = _OUTPUT_LIMIT) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _rank_exit(spec: RankSpec, rank: int, end: ProcessEnd) -> RankExit:
    try:
        result = json.loads(spec.file(rank, ".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # died or stopped before the end of its session
        result = {}
    return RankExit(
        rank=rank,
        status=end.status,
        stopped=end.order < 0,
        timed_out=end.timed_out,
        order=end.order,
        found=bool(result.get("found", False)),
        outcome=str(result.get("outcome", "")),
        phase=str(result.get("phase", "")),
        report=str(result.get("report", "")),
        output=_read_tail(spec.file(rank, ".log")),
        stack=_read_tail(spec.file(rank, ".stack")),
    )


def _rank_args(config: pytest.Config, spec_file: Path, own: Path) -> list[str]:
    """The launcher's command line, with what would clash with the launcher redirected into ``own``."""
    args = [str(arg) for arg in config.invocation_params.args]
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


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    # seed_all in the launcher set PYTHONHASHSEED and the deterministic switches here; a rank is no xdist worker
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: the ranks share the cores
    return env


@contextlib.contextmanager
def _store(timeout: float) -> Generator[Any, None, None]:
    """The process group's TCPStore, served from here on a port the system picks."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name=MASTER_ADDR,
        port=0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        yield store
    finally:
        del store  # the server stops with its last reference, the caller's, once the ranks have ended


def launch(
    item: pytest.Item, world_size: int, backend: str, timeout: float, workdir: Path, dump_dir: Path
) -> list[RankExit]:
    """Run the test's body in ``world_size`` rank processes and return how each ended."""
    config = item.config
    shutil.rmtree(workdir, ignore_errors=True)  # no result file of an earlier launch may pass for this one's
    workdir.mkdir(parents=True, exist_ok=True)
    with _store(timeout) as store:
        spec = RankSpec(
            nodeid=item.nodeid,
            path=str(item.path),
            world_size=world_size,
            backend=backend,
            master_addr=MASTER_ADDR,
            master_port=int(store.port),
            timeout=timeout,
            workdir=str(workdir),
            dump_dir=str(dump_dir),
            sys_path=tuple(sys.path),
            launcher_pid=os.getpid(),
        )
        spec_file = workdir / "spec.json"
        spec.write(spec_file)
        command = [sys.executable, "-c", _BOOT]
        ends = run_processes(
            [[*command, *_rank_args(config, spec_file, spec.file(r, ""))] for r in range(world_size)],
            [_rank_env(r, world_size, spec.master_port) for r in range(world_size)],
            config.invocation_params.dir,
            [spec.file(r, ".log") for r in range(world_size)],
            timeout,
        )
    return [_rank_exit(spec, rank, end) for rank, end in enumerate(ends)]


# -------------------------------------------------------------------------------------------------- verdict


def _tail(text: str, lines: int) -> list[str]:
    kept = text.rstrip().splitlines()[-lines:]
    return [f"  {line}" for line in kept] or ["  (nothing)"]


# frames of the machinery around the test body: pytest, pluggy, the rank's start-up
_MACHINERY = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", f"{os.sep}ranks.py", '"<string>"')


def _stacks(text: str, frames: int = 12) -> list[str]:
    """faulthandler's stacks (most recent call first), each thread's first ``frames`` frames of its own code."""
    lines: list[str] = []
    kept = 0
    for line in text.rstrip().splitlines():
        if not line.startswith(" "):  # "Current thread 0x... (most recent call first):", "Thread 0x...:"
            lines.append(f"  {line}")
            kept = 0
        elif kept < frames and not any(part in line for part in _MACHINERY):
            lines.append(f"  {line}")
            kept += 1
    return lines


def _names(ranks: Sequence[RankExit]) -> str:
    numbers = ", ".join(str(e.rank) for e in ranks)
    return f"rank {numbers}" if len(ranks) == 1 else f"ranks {numbers}"


def _others(exits: Sequence[RankExit], shown: Sequence[RankExit]) -> str:
    """What became of the ranks a message is not about: '; rank 0 passed; ranks 2, 3 were stopped'."""
    groups: dict[str, list[RankExit]] = {}
    for e in exits:
        if e in shown:
            continue
        state = "stopped" if e.stopped else (e.outcome if e.status == 0 and e.outcome else "failed")
        groups.setdefault(state, []).append(e)
    parts = []
    for state, ranks in groups.items():
        verb = ("was" if len(ranks) == 1 else "were") if state == "stopped" else ""
        parts.append(f"{_names(ranks)} {verb + ' ' if verb else ''}{state}")
    return "".join(f"; {part}" for part in parts)


def _status(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def rank_failure(exits: Sequence[RankExit], nodeid: str, timeout: float) -> tuple[int, str] | None:
    """The rank to blame and the failure message, or None when every rank ran the test and none failed.

    The rank to blame is the first to end with a failure (the others are often its victims: stopped in a
    collective it never joined), or every rank still running when the time was up.
    """
    n = len(exits)
    late = [e for e in exits if e.timed_out]
    if late:
        lines = [
            f"{_names(late)} of {n} did not finish within {timeout:g} s and "
            f"{'was' if len(late) == 1 else 'were'} stopped (raise --msprobe-rank-timeout or the marker's "
            f"rank_timeout=){_others(exits, late)}"
        ]
        for e in late:
            if e.stack.strip():
                lines += [f"rank {e.rank}'s Python stacks when stopped:", *_stacks(e.stack)]
            if e.output.strip():
                lines += [f"rank {e.rank}'s output (end):", *_tail(e.output, 10)]
        return late[0].rank, "\n".join(lines)
    ended = sorted((e for e in exits if not e.stopped), key=lambda e: e.order)
    bad = next((e for e in ended if e.status != 0 or e.outcome not in ("passed", "skipped")), None)
    if bad is None:
        return None
    head = f"rank {bad.rank} of {n}"
    others = _others(exits, [bad])
    if bad.outcome == "failed":
        at = "" if bad.phase == "call" else f" at {bad.phase}"
        return bad.rank, "\n".join(
            [f"{head} failed{at} ({_status(bad.status)}){others}", *_tail(bad.report, 30)]
        )
    if bad.status == 0 and bad.outcome == "passed":  # cannot be: kept so that every path has a message
        why = "passed"
    elif bad.outcome and bad.status != 0:
        why = f"{bad.outcome} its test but ended with {_status(bad.status)}"
    elif bad.status == 0 and not bad.found and bad.outcome == "":
        why = f"did not collect {nodeid} (exit status 0)"
    elif bad.status < 0:
        why = f"died: {_status(bad.status)}"
    elif not bad.found and bad.status in (2, 3, 4, 5):  # pytest's usage, internal, no-tests exits
        why = f"did not run {nodeid} ({_status(bad.status)})"
    else:
        why = f"ended with {_status(bad.status)} before reporting its test"
    return bad.rank, "\n".join(
        [f"{head} {why}{others}", f"rank {bad.rank}'s output (end):", *_tail(bad.output, 20)]
    )


def rank_skip(exits: Sequence[RankExit]) -> str | None:
    """The reason to skip the test when a rank skipped it (and none failed), else None."""
    skipped = [e for e in exits if e.outcome == "skipped"]
    if not skipped:
        return None
    reason = skipped[0].report.removeprefix("Skipped: ")
    return f"rank {skipped[0].rank}: {reason}"


# ------------------------------------------------------------------------------------------------ rank side


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
