"""pytest glue: options, marker, the ``msprobe`` fixture, and the hooks that turn a compare into a test result.

Thin by design: options are declared and resolved by :mod:`pytest_msprobe.options`, a test's run lives in
:mod:`pytest_msprobe.run.runner`, reports are written by :mod:`pytest_msprobe.report`. Without
``--msprobe-baseline`` (or ini ``msprobe_baseline``) and without ``--msprobe-self-check`` the plugin stays out
of the way: msprobe tests run their training steps without dumping or comparing. Importing it has torch's own
functions captured as soon as torch is imported (before any conftest or test replaces one), for the
self-check's replays (:mod:`pytest_msprobe.replay.pristine`).

Outcomes: a precision breach, a missing baseline or a dump problem of the test itself (nothing dumped, the size
limit) is a FAILED test from the call phase. A baseline that cannot be used or written leaves the test without a
verdict: it is an ERROR, from the set-up when the baseline's JSON files are broken, from the call phase when the
problem shows only during the compare (a truncated tensor file) or the regeneration (a read-only folder); those
call reports are counted as errors by :func:`pytest_report_teststatus`. In report-only mode (``report_only``) a
precision verdict (a breach, a missing baseline, an out-of-line call) is recorded and reported but does not fail
the test; the other failures and errors above stay what they are: the test did not reach a verdict.

Every checked test's entry of the session summary rides on its report (:mod:`.session_hooks` collects them and
writes ``summary.json`` and ``index.html`` at the end); the pytest-html extras link the report files relative to
the HTML report's folder, or embed them in a self-contained report.

A test marked ``world_size=N`` (N > 1) runs its body in N rank processes (:mod:`.rank_worker`, :mod:`pytest_msprobe.run.launcher`): this process, the
launcher, starts them in place of the body (:func:`pytest_pyfunc_call`), fails the test with the first rank that
failed, and then compares all ranks' dumps as one test. Each rank is a pytest process of its own on the same test,
told its part by the hidden option ``--msprobe-rank-spec``.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_msprobe.errors import BaselineError, MsprobeError
from pytest_msprobe.fixture import MsprobeFixture
from pytest_msprobe.options import (
    MARKER_HELP,
    RANK_SPEC,
    add_pytest_options,
    resolve_session,
    resolve_test,
)
from pytest_msprobe.pytest.session_hooks import ENTRY, VERDICT, SessionReports
from pytest_msprobe.replay.pristine import capture_when_torch_loads
from pytest_msprobe.report.links import Links
from pytest_msprobe.run.baseline import check_baseline_root
from pytest_msprobe.settings import SessionSettings

if TYPE_CHECKING:  # pragma: no cover (loaded when a test needs them)
    from pytest_msprobe.pytest.rank_worker import RankProcess
    from pytest_msprobe.run.runner import MsprobeRun, Outcome

capture_when_torch_loads()  # the plugin loads before conftest and test modules, which may patch torch

SESSION_KEY = pytest.StashKey[SessionSettings]()
RANK_KEY: pytest.StashKey[RankProcess] = pytest.StashKey()  # in a rank process: its part of the test
RUN_KEY: pytest.StashKey[MsprobeRun] = (
    pytest.StashKey()
)  # the item's run, behind the fixture's MsprobeFixture
OUTCOME_KEY: pytest.StashKey[Outcome] = pytest.StashKey()  # what finishing the item's run found
LINKS_KEY = pytest.StashKey[Links]()  # how the pytest-html extras link the report files
ROOT_NOTE_KEY = pytest.StashKey[str]()  # a baseline folder that does not exist yet, said before any test runs
# junitxml property: the baseline a test used (a property name that is the ini key's word, not the ini key)
BASELINE_PROPERTY = "msprobe_baseline"
REASON = "msprobe_reason"  # user property: one line, why a test that compared nothing failed or errored
CONTEXT = "msprobe_context"  # user property: checklist context that differs (environment, versions, switches)
FIRST_OUT_OF_LINE = "msprobe_first_out_of_line"  # user property: the self-check's first out-of-line call
TREND_STEP = "msprobe_trend_step"  # user property: the step where the trend first differs
# junitxml property: the test's verdict is not enforced (a property named as the ini key, as for the baseline)
REPORT_ONLY_PROPERTY = "msprobe_report_only"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_pytest_options(parser)


def _ini_dir(config: pytest.Config) -> Path:
    return config.inipath.parent if config.inipath is not None else config.rootpath


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    try:
        config.stash[SESSION_KEY] = resolve_session(
            config, config.getini, Path(config.invocation_params.dir), _ini_dir(config)
        )
        spec = config.getoption(RANK_SPEC.dest, None)
        session = config.stash[SESSION_KEY]
        if spec is None and session.baseline is not None and not hasattr(config, "workerinput"):
            # before any test trains (once, by the process that holds the session)
            compare = not (session.regen or session.report_only)  # report-only records a missing baseline
            note = check_baseline_root(session.baseline, config.rootpath, compare)
            if note is not None:
                config.stash[ROOT_NOTE_KEY] = note
        if spec is None and config.stash[SESSION_KEY].active:
            _refuse_external_ranks(os.environ)
        if spec is not None:
            from pytest_msprobe.pytest.rank_worker import RankProcess

            config.stash[RANK_KEY] = RankProcess.from_option(spec)
            config.pluginmanager.register(config.stash[RANK_KEY], "msprobe-rank")
    except MsprobeError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[LINKS_KEY] = _html_links(config)
    holds_session = not hasattr(config, "workerinput") and RANK_KEY not in config.stash
    config.pluginmanager.register(SessionReports(config.stash[SESSION_KEY], holds_session), "msprobe-summary")


def _html_links(config: pytest.Config) -> Links:
    """Links from the pytest-html report (``--html``, resolved as pytest-html resolves it) to the report files:
    relative to its folder, so that the report and the output folder downloaded together still work; embedded
    in a self-contained report."""
    path = config.getoption("htmlpath", None)
    if not path:
        return Links()
    report = Path.cwd() / Path(os.path.expandvars(path)).expanduser()
    return Links(base=str(report.parent), embed=bool(config.getoption("self_contained_html", False)))


def _refuse_external_ranks(env: Any) -> None:
    """pytest itself started as one rank of several (torchrun -m pytest): every rank would dump, regenerate and
    compare the same tests' folders at once. The ranks of a test are the plugin's to start."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1:
        raise MsprobeError(
            f"this pytest runs as rank {env.get('RANK', '?')} of WORLD_SIZE={world} (started by torchrun?): "
            "every rank would dump, write and compare the same baselines. Start pytest once, without a "
            "launcher; a test marked @pytest.mark.msprobe(world_size=N) starts its own N ranks"
        )


@pytest.fixture
def msprobe(request: pytest.FixtureRequest) -> Generator[MsprobeFixture, None, None]:
    """Seeded device and debugger for a training test, compared with its baseline after the test body.

    Example::

        @pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1])
        def test_training(msprobe: MsprobeFixture):
            model = Net().to(msprobe.device)            # initialised after seed_all(seed, mode=True)
            for x, y in batches:
                with msprobe.step(model):               # dumps the chosen steps
                    train_one_step(model, x, y)

    Run with ``--msprobe-baseline=DIR`` to compare (``--msprobe-regen-baseline`` writes the baselines).

    With ``@pytest.mark.msprobe(world_size=2)`` the body runs in two rank processes, each in the process group
    (gloo on the CPU, nccl on CUDA, hccl on the NPU): ``msprobe.rank``, ``msprobe.world_size``, and
    ``msprobe.device`` is the rank's own (``cuda:LOCAL_RANK``). Wrap the model in DDP as usual.
    """
    from pytest_msprobe.run.device import select_device
    from pytest_msprobe.run.launcher import check_launch, device_shortage
    from pytest_msprobe.run.runner import MsprobeRun

    config = request.config
    rank_process = config.stash.get(RANK_KEY, None)
    joined = False
    shortage: str | None = None
    marker = request.node.get_closest_marker("msprobe")
    try:
        if marker is not None and marker.args:
            raise MsprobeError(f"@pytest.mark.msprobe takes keywords only, got {marker.args!r}")
        settings = resolve_test(
            config,
            marker.kwargs if marker is not None else {},
            config.getini,
            _ini_dir(config),
            request.node.nodeid,
        )
        session = config.stash[SESSION_KEY]
        device = select_device(session.device)
        nodeid = request.node.nodeid
        if rank_process is not None:
            device, joined = rank_process.join(device), True
            spec = rank_process.spec
            run = MsprobeRun(
                nodeid,
                session,
                settings,
                device,
                backend=spec.backend,
                rank=rank_process.rank,
                dump_dir=Path(spec.dump_dir),
            )
        else:
            ws = settings.world_size
            shortage = device_shortage(ws, device) if ws > 1 else None
            if shortage is None:
                backend = check_launch(ws, settings.backend, device, nodeid) if ws > 1 else None
                run = MsprobeRun(nodeid, session, settings, device, backend=backend)
    except MsprobeError as exc:
        problem: str | None = str(exc)
    else:
        problem = None
    if shortage is not None:  # a machine with fewer devices than ranks cannot run the test: not a failure
        raise pytest.skip.Exception(shortage, _use_item_location=True)
    if problem is not None:  # failed outside the except block: no chained traceback in the report
        if joined and rank_process is not None:
            rank_process.leave()
        request.node.user_properties.append((VERDICT, "error"))
        request.node.user_properties.append((REASON, _first_line(problem)))
        pytest.fail(f"msprobe: {problem}", pytrace=False)
    request.node.stash[RUN_KEY] = run
    yield MsprobeFixture(run)
    try:
        run.close()  # no hooks left behind (also when the body raised); deterministic switches put back
    finally:
        if rank_process is not None:
            rank_process.leave()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A multi-rank test's body runs in its rank processes: here they are started in its place and waited for."""
    run = pyfuncitem.stash.get(RUN_KEY, None)
    if run is None or run.world_size == 1 or run.rank_process:
        return None
    from pytest_msprobe.pytest.rank_worker import launch
    from pytest_msprobe.run.rank_outcome import rank_failure, rank_skip

    timeout = run.settings.rank_timeout
    assert run.backend is not None  # chosen by check_launch for every test of several ranks
    exits = launch(pyfuncitem, run.world_size, run.backend, timeout, run.ranks_dir, run.dump_dir)
    failure = rank_failure(exits, pyfuncitem.nodeid, timeout)
    if failure is not None:
        rank, message = failure
        pyfuncitem.user_properties.append(("msprobe_failed_rank", rank))
        pytest.fail(f"msprobe: {message}", pytrace=False)
    reason = rank_skip(exits)
    if reason is not None:  # reported at the test, as a skip marker's is, not at this hook
        raise pytest.skip.Exception(reason, _use_item_location=True)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    run = item.stash.get(RUN_KEY, None)
    if run is None:
        return (yield)
    from pytest_msprobe.run.runner import FAILED, MISSING

    problem: str | None = None
    verdict = "failed"
    try:
        result = yield  # a failing test body raises here: nothing to compare
    except MsprobeError as exc:  # from the dump in the body (size limit, full disk): one line, no traceback
        problem = run.describe(exc)
    else:
        try:  # a trend that differs at a step not dumped runs the body again, to dump the steps there
            outcome = run.finish(rerun=lambda: item.ihook.pytest_pyfunc_call(pyfuncitem=item))
        except MsprobeError as exc:
            problem = run.describe(exc)
            verdict = "error" if isinstance(exc, BaselineError) else "failed"
    if problem is not None:  # failed outside the except block: no chained traceback in the report
        item.user_properties.append((VERDICT, verdict))
        item.user_properties.append((REASON, _first_line(problem)))
        if run.baseline_dir is not None:
            item.user_properties.append((BASELINE_PROPERTY, str(run.baseline_dir)))
        pytest.fail(f"msprobe: {problem}", pytrace=False)
    item.stash[OUTCOME_KEY] = outcome
    # on the item, so that the call and teardown reports (junitxml reads the latter) both carry them
    compared = outcome.result
    decided = compared.verdict if compared is not None else None
    item.user_properties.append((VERDICT, outcome.kind))
    item.user_properties.append(("msprobe_first_divergence", decided.text if decided is not None else ""))
    context = compared.checklist.context_line() if compared is not None and compared.checklist else None
    if context:  # environment and versions: shown, never a failure on their own
        item.user_properties.append((CONTEXT, context))
    if outcome.self_check is not None and outcome.self_check.out_of_line:  # the self-check without a baseline
        item.user_properties.append((FIRST_OUT_OF_LINE, outcome.self_check.out_of_line[0].name))
    if decided is not None and decided.rank is not None:  # a multi-rank dump: the rank the error entered on
        item.user_properties.append(("msprobe_first_divergence_rank", decided.rank))
    trend = outcome.result.trend if outcome.result is not None else None
    if trend is not None and trend.first_step is not None:  # where the loss or gradient norm first differs
        item.user_properties.append((TREND_STEP, trend.first_step))
    if outcome.baseline is not None:
        item.user_properties.append((BASELINE_PROPERTY, str(outcome.baseline)))
    if run.settings.report_only:
        item.user_properties.append((REPORT_ONLY_PROPERTY, "true"))
    if outcome.kind in (FAILED, MISSING):
        item.user_properties.append((REASON, _first_line(outcome.message.removeprefix("msprobe: "))))
        if not run.settings.report_only:
            pytest.fail(outcome.message, pytrace=False)
        # the test passes on the user's word; its verdict stays in the reports and this section (-rP)
        item.add_report_section("call", "msprobe (report-only: not failing the test)", outcome.message)
    return result


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked msprobe that does not take the ``msprobe`` fixture would run unseeded and undumped, and
    pass without comparing anything: that test is an error at its set-up, and the others run."""
    if (
        isinstance(item, pytest.Function)
        and item.get_closest_marker("msprobe") is not None
        and "msprobe" not in item.fixturenames
    ):
        problem = (
            f"{item.nodeid}: @pytest.mark.msprobe needs the msprobe fixture: add it to the test's "
            f"arguments (def {item.originalname}(msprobe): ...) or drop the marker"
        )
        item.user_properties.append((VERDICT, "error"))
        item.user_properties.append((REASON, problem))
        pytest.fail(f"msprobe: {problem}", pytrace=False)


def pytest_report_header(config: pytest.Config) -> list[str]:
    note = config.stash.get(ROOT_NOTE_KEY, None)
    return [] if note is None else [f"msprobe: {note}"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    entry = _entry(item, call, report)
    if entry is not None:  # (a report attribute: xdist carries it to the controller)
        setattr(report, ENTRY, entry)
    outcome = item.stash.get(OUTCOME_KEY, None) if call.when == "call" else None
    if outcome is None or outcome.result is None or not _html_report_asked(item.config):
        return report
    import pytest_html

    from pytest_msprobe.report.html import html_fragment

    extras = getattr(report, "extras", [])
    report_only = item.stash[RUN_KEY].settings.report_only
    links = item.config.stash[LINKS_KEY]
    fragment = html_fragment(
        outcome.result, outcome.reports, outcome.advisor, links=links, report_only=report_only
    )
    extras.append(pytest_html.extras.html(fragment))
    report.extras = extras
    return report


def _html_report_asked(config: pytest.Config) -> bool:
    """Whether this run writes a pytest-html report (``--html``): only then are the plots and tables of each
    test's compare drawn into it (pytest-html registers itself whenever it is installed)."""
    return config.pluginmanager.hasplugin("html") and bool(config.getoption("htmlpath", None))


def _entry(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> dict[str, Any] | None:
    """The test's entry of the session summary, from the phase that decides its verdict: the call, or a set-up
    that failed with one; None for a test that checked nothing (no msprobe run, or one that does not dump)."""
    from pytest_msprobe.report.session import test_entry
    from pytest_msprobe.run.runner import FAILED, MISSING

    props = dict(item.user_properties)
    run = item.stash.get(RUN_KEY, None)
    session = item.config.stash[SESSION_KEY]
    if call.when == "setup" and report.failed and VERDICT in props and session.active:
        return test_entry(
            item.nodeid, str(props[VERDICT]), reason=str(props.get(REASON, "")), message=str(report.longrepr)
        )
    if call.when != "call" or run is None or not run.active or run.rank_process:
        return None
    outcome = item.stash.get(OUTCOME_KEY, None)
    report_only = run.settings.report_only
    if outcome is not None:
        return test_entry(
            item.nodeid,
            outcome.kind,
            reason=str(props.get(REASON, "")),
            baseline=str(outcome.baseline) if outcome.baseline is not None else None,
            reports=outcome.reports,
            message=outcome.message if outcome.kind in (FAILED, MISSING) else "",
            report_only=report_only,
            result=outcome.result,
            self_check=outcome.self_check,
        )
    if VERDICT in props:  # a problem of the run (the dump, the baseline): it failed or errored with one line
        verdict, reason = str(props[VERDICT]), str(props.get(REASON, ""))
    elif report.skipped:
        verdict, reason = "skipped", _skip_reason(report)
    else:  # the body (or a rank) failed before anything was compared
        verdict, reason = "not compared", _body_failure(call)
    baseline = str(run.baseline_dir) if run.baseline_dir is not None else None
    message = str(report.longrepr) if report.failed else ""
    return test_entry(
        item.nodeid, verdict, reason=reason, baseline=baseline, message=message, report_only=report_only
    )


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else _first_line(str(longrepr))


def _body_failure(call: pytest.CallInfo[None]) -> str:
    """One line: what ended the test before its compare."""
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, pytest.fail.Exception):
        return _first_line(exc.msg or "").removeprefix("msprobe: ")
    if call.excinfo is None:
        return "the test ended before its compare"
    return f"the test body raised {call.excinfo.typename}: {_first_line(str(exc))}"


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    """A call phase that could not reach a verdict (an unusable baseline found by the compare, a baseline that
    cannot be written) counts as an error, as a set-up that fails does."""
    if report.when == "call" and report.failed and dict(report.user_properties).get(VERDICT) == "error":
        return "error", "E", "ERROR"
    return None
