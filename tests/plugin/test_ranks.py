"""Multi-rank tests (marker ``world_size=N``): the body runs in N rank processes under torch.distributed (gloo on
the CPU), the verdict covers every rank, and a rank that fails, raises or hangs fails the test naming it."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from plugin_sources import BASE, with_net

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.options import resolve_test
from pytest_msprobe.run.launcher import RankExit, device_shortage, run_processes
from pytest_msprobe.run.rank_outcome import rank_failure, rank_skip
from pytest_msprobe.settings import DEFAULT_RANK_TIMEOUT
from tests.processes import children

# A tiny model trained under DDP for two steps, on data that differs per rank; the second F.relu of a forward is
# the one the fault plugin breaks.
DDP_TEST = with_net(
    textwrap.dedent(
        """
        import os

        import pytest
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP


        NET


        @pytest.mark.msprobe(world_size=2, steps=[0, 1], level="mix")  # the DDP model's modules and its API calls
        def test_ddp(msprobe):
            env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
            assert env == {"RANK": str(msprobe.rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(msprobe.rank),
                           "MASTER_ADDR": "127.0.0.1"}
            assert (dist.get_rank(), dist.get_world_size(), msprobe.world_size) == (msprobe.rank, 2, 2)
            # the same seed on every rank: the same first draw
            drawn = [torch.empty(3) for _ in range(2)]
            dist.all_gather(drawn, torch.rand(3))
            assert torch.equal(drawn[0], drawn[1])
            model = DDP(Net().to(msprobe.device))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(msprobe.rank)  # each rank its own batches
            for _ in range(2):
                x = torch.randn(4, 3, 8, 8, generator=g)
                y = torch.randint(0, 4, (4,), generator=g)
                with msprobe.step(model):
                    out = model(x)
                    summed = out.detach().clone()
                    dist.all_reduce(summed)  # the logits summed over the ranks, e.g. for a global metric
                    loss = F.cross_entropy(out, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        """
    ),
    bn=False,
)

# the fault plugin of conftest.py, on rank 1 only
RANK1_FAULT = textwrap.dedent(
    """
    import os

    if os.environ.get("RANK") == "1":
        from faultplugin import pytest_configure, pytest_unconfigure  # noqa: F401
    """
)

BAD_RANKS = textwrap.dedent(
    """
    import time

    import pytest
    import torch.distributed as dist


    @pytest.mark.msprobe(world_size=2)
    def test_raises(msprobe):
        print(f"rank {msprobe.rank} starts")
        if msprobe.rank == 1:
            raise ValueError("rank one is broken")
        dist.barrier()  # never joined by rank 1: rank 0 waits here until it is stopped


    @pytest.mark.msprobe(world_size=2)
    def test_hangs(msprobe):
        if msprobe.rank == 1:
            time.sleep(600)
        dist.barrier()
    """
)


def _properties(xml: Path) -> dict[str, str]:
    case = ET.parse(xml).getroot().find(".//testcase")
    assert case is not None
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
@pytest.mark.slow
def test_two_gloo_ranks_regen_pass_and_a_fault_on_rank_one_names_rank_one(
    pytester: pytest.Pytester, fault_plugin: str
) -> None:
    pytester.makepyfile(test_ddp=DDP_TEST, rank1fault=RANK1_FAULT)
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    baseline = pytester.path / "bl" / "test_ddp" / "test_ddp"
    dumps = sorted(str(p.parent.relative_to(baseline)) for p in baseline.glob("step*/rank*/dump.json"))
    assert dumps == ["step0/rank0", "step0/rank1", "step1/rank0", "step1/rank1"]
    manifest = json.loads((baseline / "msprobe_manifest.json").read_text())
    assert (manifest["extra"]["world_size"], manifest["extra"]["backend"]) == (2, "gloo")
    ranks = [json.loads((baseline / f"step0/rank{r}/dump.json").read_text()) for r in (0, 1)]
    assert ranks[0]["data"] != ranks[1]["data"]  # each rank its own batches
    assert all("Module.module.conv2.Conv2d.forward.0" in r["data"] for r in ranks)  # inside the DDP wrapper
    reduces = [r["data"]["Distributed.all_reduce.0.forward"] for r in ranks]  # captured on every rank
    assert reduces[0]["input_args"][0]["Max"] != reduces[1]["input_args"][0]["Max"]
    assert reduces[0]["output"][0]["Max"] == reduces[1]["output"][0]["Max"]  # the reduced sum, on both

    clean = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--junitxml=clean.xml")
    clean.assert_outcomes(passed=1)
    assert "msprobe_first_divergence_rank" not in _properties(pytester.path / "clean.xml")

    faulty = pytester.runpytest(*BASE, "-p", "rank1fault", "--msprobe-baseline=bl", "--junitxml=fault.xml")
    faulty.assert_outcomes(failed=1)
    faulty.stdout.fnmatch_lines(
        [
            "first divergence: Functional.relu.1.forward (step 0, rank 1), row *",
            "*while its inputs match the baseline*",
            "FAILED*test_ddp.py::test_ddp*(first divergence Functional.relu.1.forward on rank 1)",
        ]
    )
    props = _properties(pytester.path / "fault.xml")
    assert (props["msprobe_first_divergence"], props["msprobe_first_divergence_rank"]) == (
        "Functional.relu.1.forward",
        "1",
    )
    # the session summary: one test (the rank processes write none), its first divergence on rank 1
    (entry,) = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())["tests"]
    assert (entry["nodeid"], entry["verdict"]) == ("test_ddp.py::test_ddp", "failed")
    first = entry["first_divergence"]
    assert (first["api"], first["step"], first["rank"]) == ("Functional.relu.1.forward", 0, 1)
    assert first["source"].startswith(f"File {pytester.path / 'test_ddp.py'}, line ")
    kept = pytester.path / "msprobe-output" / "test_ddp" / "test_ddp"
    # rank 0 breaches too (its all_reduce of the logits on clean local inputs, and the gradients DDP reduced):
    # rank 1's contribution carried the error there, and the first divergence is still rank 1's relu
    summary = json.loads((kept / "compare" / "summary.json").read_text())
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    assert by_rank[0]["passed"] is False
    rank0 = {f["api"] for f in summary["failures"] if f["rank"] == 0}
    assert "Distributed.all_reduce.0.forward" in rank0, "its inputs are clean on rank 0, its output is not"
    assert "Functional.relu.1.forward" not in rank0
    assert (kept / "dump" / "step0" / "rank1" / "dump.json").is_file()  # a failure keeps every rank's dump
    assert (kept / "ranks" / "rank1.log").is_file()
    assert children() == []


XDIST = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist


    @pytest.mark.msprobe(world_size=2)
    def test_sums(msprobe):
        total = torch.tensor([float(msprobe.rank + 1)])
        dist.all_reduce(total)
        assert total.item() == 3.0
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")
@pytest.mark.slow
def test_multi_rank_tests_under_xdist_get_their_own_process_groups(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sums=XDIST, test_bad=BAD_RANKS)
    # two workers, each launching two ranks at the same time: a shared port or folder would break one of them
    result = pytester.runpytest_subprocess(*BASE, "-n", "2", "-k", "sums or raises")
    result.assert_outcomes(passed=1, failed=1)
    # rank 0 waits in a barrier rank 1 never joins: it is stopped as soon as rank 1 fails, not at the timeout
    result.stdout.fnmatch_lines(
        [
            "msprobe: rank 1 of 2 failed (exit status 1); rank 0 was stopped",
            '*raise ValueError("rank one is broken")',
            "*E*ValueError: rank one is broken",
            "*test_bad.py:11: ValueError",
        ]
    )
    assert "did not finish" not in result.stdout.str()
    output = pytester.path / "msprobe-output"
    assert not (output / "test_sums" / "test_sums").exists()  # nothing compared: the ranks' logs are gone
    assert (output / "test_bad" / "test_raises" / "ranks" / "rank1.log").is_file()  # a failure's are kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
def test_a_hanging_rank_is_stopped_at_the_timeout_with_every_rank_stack(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad=BAD_RANKS)
    result = pytester.runpytest(*BASE, "-k", "hangs", "--msprobe-rank-timeout=10")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "msprobe: ranks 0, 1 of 2 did not finish within 10 s and were stopped (raise --msprobe-rank-timeout*",
            "rank 0's Python stacks when stopped:",
            "*in barrier",
            "*test_bad.py*, line 19 in test_hangs",
            "rank 1's Python stacks when stopped:",
            "*test_bad.py*, line 18 in test_hangs",
        ]
    )
    out = result.stdout.str()
    report = out[out.index(" FAILURES ") : out.index(" short test summary info ")]
    report = report.split(" warnings summary ")[0]  # pytest's own warnings may name _pytest files
    assert "rank 1's Python stacks" in report and "_pytest" not in report  # the test's frames, not pytest's
    assert children() == []


# rank 1 fails before it joins the process group (as on a machine without its device); rank 0 joins and waits
# for it in init_process_group
EARLY_FAILURE = textwrap.dedent(
    """
    import os

    import pytest


    @pytest.fixture
    def device_check():
        if os.environ.get("RANK") == "1":  # the launcher, which runs the fixtures too, has no RANK
            raise RuntimeError("rank 1 cannot start: invalid device ordinal")


    @pytest.mark.msprobe(world_size=2)
    def test_early(device_check, msprobe):
        pass
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
def test_a_rank_failing_before_the_process_group_stops_the_others_with_its_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_early=EARLY_FAILURE)
    result = pytester.runpytest(*BASE, "--msprobe-rank-timeout=600")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "msprobe: rank 1 of 2 failed at setup (exit status 1); rank 0 was stopped",
            "*RuntimeError: rank 1 cannot start: invalid device ordinal",
        ]
    )
    assert "did not finish within" not in result.stdout.str()  # ended by rank 1's failure, not the timeout
    assert children() == []


def test_a_multi_rank_test_skips_with_fewer_devices_than_ranks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``world_size=2`` on a one-GPU machine: a skip naming both counts, before any rank starts."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.msprobe(world_size=2)\ndef test_two(msprobe):\n    assert False\n"
    )
    result = pytester.runpytest(*BASE, "-rs", "--msprobe-device=cuda", "--msprobe-baseline=bl")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [1] test_a_multi_rank_test_skips_with_fewer_devices_than_ranks.py:3: needs 2 cuda devices "
            "(one per rank), this machine has 1"
        ]
    )
    assert not list(pytester.path.rglob("rank0.log"))  # no rank was started


def test_device_shortage_counts_from_the_device_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_shortage(2, torch.device("cuda", 0)) is None
    assert device_shortage(3, torch.device("cuda", 0)) == (
        "needs 3 cuda devices (one per rank), this machine has 2"
    )
    assert device_shortage(2, torch.device("cuda", 1)) == (
        "needs 2 cuda devices from cuda:1 (one per rank), this machine has 2"
    )
    assert device_shortage(64, torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("world_size=0", "*world_size must be an integer >= 1, got 0"),
        ("world_size=2, backend='nope'", "*torch.distributed backend 'nope' is not available here*"),
        ("world_size=2, rank_timeout=-1", "*rank_timeout: expected a positive number of seconds, got -1"),
    ],
)
def test_bad_multi_rank_settings_are_errors_naming_the_value(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.msprobe({marker})\ndef test_x(msprobe):\n    pass\n")
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"msprobe: {message}"])


def test_rank_timeout_resolves_command_line_over_marker_over_ini(tmp_path: Path) -> None:
    def resolve(cli: Any, marker: dict[str, Any], ini: str) -> float:
        options = {"msprobe_rank_timeout": cli}
        ini_values = {"msprobe_rank_timeout": ini}
        return resolve_test(options.get, marker, lambda k: ini_values.get(k, ""), tmp_path).rank_timeout

    assert resolve(None, {}, "") == DEFAULT_RANK_TIMEOUT
    assert resolve(None, {}, "30") == 30.0
    assert resolve(None, {"rank_timeout": 5}, "30") == 5.0
    assert resolve("7.5", {"rank_timeout": 5}, "30") == 7.5
    with pytest.raises(
        ConfigError, match=r"--msprobe-rank-timeout: expected a number of seconds, got 'soon'"
    ):
        resolve("soon", {}, "")
    settings = resolve_test(lambda k: None, {"world_size": 4, "backend": "GLOO"}, lambda k: "", tmp_path)
    assert (settings.world_size, settings.backend) == (4, "gloo")


def _sleeper(seconds: float, status: int = 0) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit({status})"]


@pytest.mark.skipif(os.name != "posix", reason="process groups and signals")
def test_run_processes_stops_the_others_when_one_fails(tmp_path: Path) -> None:
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    start = time.monotonic()
    ends = run_processes([_sleeper(0, 3), _sleeper(60)], [dict(os.environ)] * 2, tmp_path, logs, 60)
    assert time.monotonic() - start < 30  # not the other's 60 s
    assert (ends[0].status, ends[0].order, ends[0].timed_out) == (3, 0, False)
    # stopped as torchrun stops a rank: SIGTERM first, which a rank blocked in a collective dies of
    assert (ends[1].status, ends[1].order, ends[1].timed_out) == (-signal.SIGTERM, -1, False)
    assert children() == []


@pytest.mark.skipif(os.name != "posix", reason="process groups and signals")
def test_run_processes_kills_what_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    ends = run_processes(
        [_sleeper(0.5, 3), [sys.executable, "-c", deaf]], [dict(os.environ)] * 2, tmp_path, logs, 60, grace=1
    )
    assert (ends[0].status, ends[0].order) == (3, 0)
    assert (ends[1].status, ends[1].order, ends[1].timed_out) == (-signal.SIGKILL, -1, False)
    assert children() == []


@pytest.mark.skipif(os.name != "posix", reason="process groups and signals")
def test_run_processes_counts_the_timeout_from_when_every_process_is_ready(tmp_path: Path) -> None:
    # a slow start (rank 1 "imports torch" for 3 s) is not the test's time: the 1 s count from the last ready
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]

    def starter(delay: float, path: Path) -> list[str]:
        body = (
            f"import pathlib, time; time.sleep({delay}); pathlib.Path({str(path)!r}).touch(); time.sleep(60)"
        )
        return [sys.executable, "-c", body]

    start = time.monotonic()
    ends = run_processes(
        [starter(0, ready[0]), starter(3, ready[1])], [dict(os.environ)] * 2, tmp_path, logs, 1, ready=ready
    )
    assert all(path.exists() for path in ready)  # neither was stopped while starting
    assert time.monotonic() - start >= 4  # 3 s of start-up, then the 1 s
    assert [(end.order, end.timed_out) for end in ends] == [(-1, True), (-1, True)]
    assert children() == []


@pytest.mark.skipif(os.name != "posix", reason="process groups and signals")
def test_run_processes_reaps_every_process_on_keyboard_interrupt(tmp_path: Path) -> None:
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_processes([_sleeper(60), _sleeper(60)], [dict(os.environ)] * 2, tmp_path, logs, 60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert children() == []


def _exit(rank: int, status: int = 0, order: int = 0, outcome: str = "passed", **more: Any) -> RankExit:
    fields: dict[str, Any] = dict(
        rank=rank,
        status=status,
        stopped=order < 0,
        timed_out=False,
        order=order,
        found=True,
        outcome=outcome,
        phase="call",
        report="",
        output="",
        stack="",
    )
    return RankExit(**{**fields, **more})


@pytest.mark.parametrize(
    ("exits", "blamed", "headline"),
    [
        ([_exit(0), _exit(1, order=1)], None, ""),
        (  # rank 1 failed first; rank 0's later failure is what rank 1 did to it
            [_exit(0, 1, 1, "failed"), _exit(1, 1, 0, "failed", report="E   ValueError: x")],
            1,
            "rank 1 of 2 failed (exit status 1); rank 0 failed",
        ),
        (
            [_exit(0, -9, -1, ""), _exit(1, -11, 0, "", found=False, output="Fatal Python error")],
            1,
            "rank 1 of 2 died: killed by SIGSEGV; rank 0 was stopped",
        ),
        (
            [_exit(0, 0, 0), _exit(1, 3, 1, "passed")],
            1,
            "rank 1 of 2 passed its test but ended with exit status 3; rank 0 passed",
        ),
        (
            [_exit(0, 4, 0, "", found=False), _exit(1, -9, -1, "")],
            0,
            "rank 0 of 2 did not run t.py::test (exit status 4); rank 1 was stopped",
        ),
        (
            [_exit(0, -9, -1, "", timed_out=True), _exit(1, 0, 0)],
            0,
            "rank 0 of 2 did not finish within 5 s and was stopped (raise --msprobe-rank-timeout or the "
            "marker's rank_timeout=); rank 1 passed",
        ),
        (  # stuck before the process group (the clock had not started): the start-up's own limit
            [_exit(0, -9, -1, "", timed_out=True, started=False), _exit(1, -9, -1, "", timed_out=True)],
            0,
            "ranks 0, 1 of 2 did not join the process group within 305 s and were stopped (raise "
            "--msprobe-rank-timeout or the marker's rank_timeout=)",
        ),
    ],
)
def test_rank_failure_blames_the_first_rank_to_fail(
    exits: list[RankExit], blamed: int | None, headline: str
) -> None:
    failure = rank_failure(exits, "t.py::test", 5.0)
    if blamed is None:
        assert failure is None
        return
    assert failure is not None
    assert failure[0] == blamed
    assert failure[1].splitlines()[0] == headline


def test_a_skip_on_any_rank_skips_the_test() -> None:
    assert rank_skip([_exit(0), _exit(1, outcome="skipped", report="Skipped: no GPU")]) == "rank 1: no GPU"
    assert rank_skip([_exit(0), _exit(1)]) is None


def test_pytest_started_as_one_of_several_ranks_is_refused(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torchrun --nproc-per-node 2 -m pytest``: each rank would write and compare the same baselines."""
    pytester.makepyfile("def test_x(msprobe):\n    pass\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    refused = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*this pytest runs as rank 1 of WORLD_SIZE=2 (started by torchrun?)*"])
    assert not (pytester.path / "bl").exists()
    # without a baseline the plugin stays out of the way: the tests run as plain tests
    pytester.runpytest(*BASE).assert_outcomes(passed=1)
