"""Multi-rank tests: the body of a test marked ``world_size=N`` runs in N rank processes, torchrun-style.

The pytest process that collected the test (the launcher) does not run the body. It starts N child pytest
processes on the same test, each told its part by the hidden option ``--msprobe-rank-spec`` and the environment
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank joins the
process group through a TCPStore that the launcher holds (its port is bound before any rank needs it, so no two
tests or xdist workers can share one), runs the fixture and the body, and dumps ``step{N}/rank{R}/`` into the
test's dump folder; the launcher then compares all ranks at once. The first rank that fails or dies stops the
others at once (SIGTERM, then SIGKILL after a grace period, as torchrun does), also those still waiting for it
in the rendezvous; ranks still running when the time is up write their Python stacks and are stopped. The time
counts from the moment every rank has joined the process group (each says so with a ``rank{R}.ready`` file):
starting Python and importing torch on a loaded machine is not the test's hang, and has a limit of its own
(the timeout and :data:`RANK_STARTUP` more). Every
rank is reaped on every path (a failure, the timeout, Ctrl-C), and a rank whose launcher dies is killed by the
kernel. A machine with fewer devices than ranks (one each) skips the test before any rank starts.

The rank's command line and the pytest plugin it runs are :mod:`pytest_msprobe.pytest.rank_worker`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.format.files import read_json
from pytest_msprobe.options import RANK_SPEC
from pytest_msprobe.settings import RANK_STARTUP

if TYPE_CHECKING:  # pragma: no cover
    import torch

SPEC_OPTION = RANK_SPEC.flag
DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
MASTER_ADDR = "127.0.0.1"
STACK_SIGNAL = signal.SIGUSR1  # asks a rank for its Python stacks (faulthandler) before it is killed
_STACK_GRACE = 0.5  # seconds for the stacks to be written: faulthandler writes from the signal handler itself
_TERM_GRACE = 5.0  # seconds the ranks still running get after SIGTERM, before SIGKILL (torchrun's order)
_POLL = 0.05
_OUTPUT_LIMIT = 1 << 20  # bytes of a rank's output kept for the test report
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
    timeout: float  # of the process group: longer than the launcher's, which stops a hung rank first
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
        data = read_json(path, lambda file, why: ConfigError(f"{file}: unusable rank spec ({why})"))
        try:
            return cls(**{**data, "sys_path": tuple(data["sys_path"])})
        except (TypeError, KeyError) as exc:
            raise ConfigError(f"{path}: unusable rank spec ({exc!r})") from None


# ------------------------------------------------------------------------------------------------ launcher


def check_launch(world_size: int, backend: str | None, device: torch.device, where: str) -> str:
    """The backend the ranks of a test will use (by device when not given); ConfigError when they cannot start
    whatever the machine (too few devices is :func:`device_shortage`'s: a skip)."""
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
    return name


def device_shortage(world_size: int, device: torch.device) -> str | None:
    """Why this machine cannot give each of ``world_size`` ranks its own ``device`` (rank R takes device
    index + R), or None when it can: the reason a multi-rank test is skipped here."""
    import torch

    if device.type == "cpu":
        return None
    count = int(getattr(torch, device.type).device_count())
    first = device.index or 0
    if first + world_size <= count:
        return None
    start = f" from {device.type}:{first}" if first else ""
    return f"needs {world_size} {device.type} devices{start} (one per rank), this machine has {count}"


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


def _terminate(procs: Sequence[subprocess.Popen[bytes]], running: Sequence[int], grace: float) -> None:
    """SIGTERM to the process groups of ``running`` and wait up to ``grace`` s for those processes to end (left
    unreaped, as in :func:`_poll_exit`); what is left is the caller's to kill."""
    for i in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(procs[i].pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = list(running)
    while left and time.monotonic() < deadline:
        time.sleep(_POLL)
        left = [i for i in left if _poll_exit(procs[i]) is None]


def run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict[str, str]],
    cwd: str | os.PathLike[str],
    logs: Sequence[Path],
    timeout: float,
    grace: float = _TERM_GRACE,
    ready: Sequence[Path] = (),
) -> list[ProcessEnd]:
    """Run the commands side by side until all have ended, one has failed (a non-zero status or a signal: the
    others are stopped at once) or ``timeout`` seconds have passed (those still running get STACK_SIGNAL, then
    are stopped). Given ``ready`` (a file each process creates once it has started), the seconds count from
    the moment all of them exist, and the start-up before it may take ``timeout`` + :data:`RANK_STARTUP`.

    Each runs in a session of its own (a terminal's Ctrl-C reaches only us) with stdout and stderr appended to
    its log. Stopping is torchrun's: SIGTERM to each process group, SIGKILL to what is left after ``grace``
    seconds (at once on an interrupt). Every process is reaped before this returns or raises.
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
        starting = bool(ready)
        deadline = time.monotonic() + timeout + (RANK_STARTUP if starting else 0.0)
        while True:
            for i, proc in enumerate(procs):
                if i not in ended and (status := _poll_exit(proc)) is not None:
                    ended[i] = (status, len(ended))
            if len(ended) == len(procs) or any(status != 0 for status, _ in ended.values()):
                break
            if starting and all(path.exists() for path in ready):  # all started: the test's own time begins
                starting, deadline = False, time.monotonic() + timeout
            if time.monotonic() >= deadline:
                late = {i for i in range(len(procs)) if i not in ended}
                for i in late:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[i].pid, STACK_SIGNAL)
                time.sleep(_STACK_GRACE)
                break
            time.sleep(_POLL)
        _terminate(procs, [i for i in range(len(procs)) if i not in ended], grace)
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
    started: bool = True  # it had joined the process group (its ready file): the timeout's clock had started


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
        started=spec.file(rank, ".ready").exists(),
    )


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
    nodeid: str,
    path: Path,
    world_size: int,
    backend: str,
    timeout: float,
    workdir: Path,
    dump_dir: Path,
    command: Callable[[Path, Path], list[str]],
    cwd: str | os.PathLike[str],
) -> list[RankExit]:
    """Run a test's body in ``world_size`` rank processes and return how each ended.

    ``command(spec_file, own)`` is a rank's command line, given the spec file and the rank's own folder prefix
    (for what would clash with the launcher: basetemp, reports).
    """
    shutil.rmtree(workdir, ignore_errors=True)  # no result file of an earlier launch may pass for this one's
    workdir.mkdir(parents=True, exist_ok=True)
    group_timeout = timeout + RANK_STARTUP  # the launcher stops a hung rank before the process group gives up
    with _store(group_timeout) as store:
        spec = RankSpec(
            nodeid=nodeid,
            path=str(path),
            world_size=world_size,
            backend=backend,
            master_addr=MASTER_ADDR,
            master_port=int(store.port),
            timeout=group_timeout,
            workdir=str(workdir),
            dump_dir=str(dump_dir),
            sys_path=tuple(sys.path),
            launcher_pid=os.getpid(),
        )
        spec_file = workdir / "spec.json"
        spec.write(spec_file)
        ends = run_processes(
            [command(spec_file, spec.file(r, "")) for r in range(world_size)],
            [_rank_env(r, world_size, spec.master_port) for r in range(world_size)],
            cwd,
            [spec.file(r, ".log") for r in range(world_size)],
            timeout,
            ready=[spec.file(r, ".ready") for r in range(world_size)],
        )
    return [_rank_exit(spec, rank, end) for rank, end in enumerate(ends)]
