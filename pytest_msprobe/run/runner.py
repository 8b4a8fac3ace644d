"""One msprobe test's run: seed, device, debugger, then regenerate the baseline or compare against it.

This is what the ``msprobe`` fixture hands a test, and what the plugin finishes after the test body. It holds
no pytest state: :meth:`MsprobeRun.finish` returns an :class:`Outcome` that the plugin turns into a pass or a
failure, and raises :class:`BaselineError` for what leaves the test without a verdict (a baseline that cannot be
read or written), which the plugin reports as an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_msprobe import options
from pytest_msprobe.dump.determinism import SEED_ENV, seed_all
from pytest_msprobe.errors import (
    BaselineError,
    BaselineMismatchError,
    ConfigError,
    DumpFormatError,
    DumpSizeError,
    MsprobeError,
)
from pytest_msprobe.run.baseline import BaselineStore, Manifest, baseline_folder, is_dump_root, root_holding
from pytest_msprobe.run.fit import check_baseline, numbers
from pytest_msprobe.run.folders import claim_folder, clear_folder, is_inside
from pytest_msprobe.run.trend import baseline_steps, check_trend, compare_with_trend, write_trend
from pytest_msprobe.settings import SessionSettings, TestSettings, check_apart
from pytest_msprobe.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pytest_msprobe.compare.judging import SelfCheckResult
    from pytest_msprobe.compare.result import CompareResult

# outcome kinds
INACTIVE, REGENERATED, PASSED, FAILED, MISSING = "inactive", "regenerated", "passed", "failed", "missing"


@dataclass(frozen=True)
class Outcome:
    """What finishing a run found."""

    kind: str
    message: str = ""
    baseline: Path | None = None
    result: CompareResult | None = None
    reports: dict[str, str] = field(default_factory=dict)
    advisor: str = ""  # the advisor's text, as written to its report (the HTML fragment shows it)
    self_check: SelfCheckResult | None = None  # the self-check's verdict, without a baseline


class _NoDump:
    """The debugger of a run that checks nothing (no --msprobe-baseline, no --msprobe-self-check): the training
    steps just run."""

    current_step = 0

    def start(self, model: Any = None) -> None:
        pass

    def stop(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Determinism:
    """The process-wide switches the fixture changes, so a test leaves them as it found them: those
    seed_all(mode=True) sets, and TF32 / HF32 switched off (float32 math in float32 on every device) unless the
    test allows them."""

    algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    env: dict[str, str | None]
    precision: Callable[[], None] | None = None  # puts TF32 / HF32 back; None: they were left as they were

    @classmethod
    def save(cls) -> _Determinism:
        import os

        import torch

        return cls(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            {name: os.environ.get(name) for name in SEED_ENV},
        )

    @classmethod
    def enter(cls, seed: int, allow_tf32: bool) -> _Determinism:
        """Save the switches, seed, and (unless ``allow_tf32``) switch TF32 and HF32 off."""
        saved = cls.save()
        seed_all(seed=seed, mode=True)
        if allow_tf32:  # the production setting: the checklist records it
            return saved
        from pytest_msprobe.dump.switches import strict_float32

        return dataclasses.replace(saved, precision=strict_float32())

    def restore(self) -> None:
        import os

        import torch

        torch.use_deterministic_algorithms(self.algorithms, warn_only=self.warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.precision is not None:
            self.precision()


class MsprobeRun:
    """The ``msprobe`` fixture's value: the device to train on and the debugger that dumps the chosen steps.

    In a test, wrap each training step (forward, loss, backward, optimizer step)::

        for images, target in batches:
            with msprobe.step(model):           # or msprobe.debugger.start() / stop() / step()
                train_one_step(...)

    The seed is set (``seed_all(seed, mode=True)``) before the test body runs, so model initialisation is the
    same on every device, and on every rank of a multi-rank test (``rank``, ``world_size``): data that should
    differ per rank is the test's to make so. float32 math is computed in float32 on every device (TF32 and HF32
    off) unless the test allows them (``allow_tf32``); every switch is put back after the test.

    A test of ``world_size`` N > 1 has N + 1 runs: the launcher's, which never runs the body but regenerates or
    compares all ranks' dumps at once (:meth:`finish`), and one per rank process (``rank`` given), which dumps
    ``step{N}/rank{R}/`` into the launcher's ``dump_dir`` and leaves the baseline alone.
    """

    def __init__(
        self,
        nodeid: str,
        session: SessionSettings,
        test: TestSettings,
        device: torch.device,
        *,
        backend: str | None = None,
        rank: int | None = None,
        dump_dir: Path | None = None,
    ) -> None:
        self.nodeid = nodeid
        self.session = session
        self.settings = test
        self.device = device
        self.seed = test.seed
        self.steps = test.steps
        self.world_size = test.world_size
        self.backend = backend  # of the process group, for a multi-rank test
        self.rank_process = rank is not None
        self.rank = rank if rank is not None else 0
        self._in_step = False
        # with a trend, a regenerated baseline dumps every trend step; a compare dumps the test's steps
        self.trend_steps = test.trend_steps if session.active else None
        self.dump_steps = baseline_steps(test) if self.trend_steps and session.regen else self.steps
        self.trend: Any = None  # the TrendRecorder, with trend_steps
        self._lock: int | None = None  # holds this run's output folder (see claim_folder)
        self.output_dir = session.output / baseline_folder(nodeid)
        self.store = BaselineStore(session.baseline) if session.baseline is not None else None
        self.baseline_dir = self.store.path_for(nodeid) if self.store is not None else None
        if self.baseline_dir is not None:  # a baseline folder linked from elsewhere may hold the output
            check_apart(session.output, self.baseline_dir, flag=options.OUTPUT.flag)
        if self.store is not None and not session.regen and not self.rank_process:
            with self.store.reading(nodeid) as folder:
                if is_dump_root(folder):
                    try:
                        check_baseline(folder, test)
                    except BaselineMismatchError as exc:
                        raise BaselineError(f"{exc}; regenerate it: {self.regen_command()}") from None
                    except (DumpFormatError, BaselineError) as exc:
                        raise BaselineError(f"unusable baseline: {exc}") from None
        if self.active and not self.rank_process:
            # a folder of its own: the same test in another worker or session never shares or clears it
            self.output_dir, self._lock = claim_folder(self.output_dir)
            try:  # a test's output folder linked into the baselines must not be cleared
                for baseline in (session.baseline, self.baseline_dir):
                    if baseline is not None:
                        check_apart(
                            self.output_dir, baseline, "the test's output folder", options.OUTPUT.flag
                        )
            except ConfigError:
                self._release()
                raise
            clear_folder(self.output_dir)  # what an earlier run of this test left
        self.dump_dir = dump_dir if dump_dir is not None else self.output_dir / "dump"
        self.report_dir = self.output_dir / "compare"
        self.ranks_dir = self.output_dir / "ranks"  # the rank processes' logs and results
        self.debugger: Any = _NoDump()
        try:
            if self.active:
                self.debugger = self._debugger(self.dump_dir, self.dump_steps)
            self._new_trend()
            self._determinism = _Determinism.enter(test.seed, test.allow_tf32)
        except BaseException:  # no run to close: the folder is let go here
            self._release()
            raise

    def _debugger(self, dump_dir: Path, steps: tuple[int, ...]) -> Any:
        from pytest_msprobe import PrecisionDebugger

        test = self.settings
        md5 = test.task == "md5"  # msprobe's form: task statistics with summary_mode md5
        return PrecisionDebugger(
            dump_path=str(dump_dir),
            task="statistics" if md5 else test.task,
            level=test.level,
            step=list(steps),
            summary_mode="md5" if md5 else None,
            max_dump_size=test.max_dump_size,
            self_check=test.self_check,
            checklist_env=test.checklist_env,
            # the gate holds every overflow of the target against the baseline's, not just the first
            overflow_nums=-1 if test.task == "overflow_check" else None,
        )

    def _new_trend(self) -> None:
        if self.trend_steps:
            from pytest_msprobe.dump.trend_recorder import TrendRecorder

            self.trend = TrendRecorder(self.trend_steps)

    def loss(self, value: Any) -> None:
        """Give the step's loss (a number or a one-element tensor) to the trend, inside ``msprobe.step``::

            with msprobe.step(model):
                loss = F.cross_entropy(model(x), y)
                msprobe.loss(loss)                  # the last value given in a step counts
                ...

        With ``trend_steps=N`` each of the first N steps must give one; without a trend it is not recorded.
        """
        if not self._in_step:
            raise ConfigError(
                "msprobe.loss() outside msprobe.step(): give the step's loss inside 'with msprobe.step(model):'"
            )
        if self.trend is not None:
            self.trend.loss(value)

    @property
    def active(self) -> bool:
        """Whether the run dumps: to compare with a baseline, or for the self-check (which needs none)."""
        return self.session.active or self.settings.self_check

    @contextlib.contextmanager
    def step(self, model: Any = None) -> Iterator[None]:
        """Dump one training step (when it is one of the chosen steps): start, run the body, stop, advance."""
        needs_model = self.settings.level in ("L0", "mix")
        if needs_model and model is None and self.active:
            raise ConfigError(
                f"level {self.settings.level} dumps modules: pass the model, msprobe.step(model)"
            )
        if self._in_step:
            raise ConfigError(
                f"msprobe.step() inside msprobe.step() (step {self.debugger.current_step}): steps do not nest; "
                "open one 'with msprobe.step(model):' per training step"
            )
        trend = self.trend
        if trend is not None:
            trend.begin(model)  # (a ConfigError without the model)
        self._in_step = True
        interrupted, failed = True, False
        try:
            # the model also at L1: the checklist fingerprints its weights and takes the batch from its forward
            self.debugger.start(model) if model is not None else self.debugger.start()
            yield
            interrupted = False
        except Exception:  # the body failed: the step's records are whole, they are written as usual
            interrupted, failed = False, True
            raise
        finally:
            try:
                if interrupted:  # Ctrl-C or a timeout at any point of the step: drop it, leave nothing behind
                    self.debugger.abort()
                else:
                    self.debugger.stop()
                    self.debugger.step()
            except BaseException:
                if trend is not None:
                    trend.abort()
                raise
            finally:
                self._in_step = False
            if trend is not None:  # the step's values in one host sync; no loss given: a ConfigError
                trend.abort() if interrupted or failed else trend.end()

    def manifest(self) -> Manifest:
        import torch

        from pytest_msprobe.run.device import describe_device

        torch_npu = sys.modules.get("torch_npu")
        return Manifest(
            test=self.nodeid,
            device=describe_device(self.device),
            torch=torch.__version__,
            torch_npu=getattr(torch_npu, "__version__", None) if torch_npu is not None else None,
            plugin=__version__,
            seed=self.seed,
            task=self.settings.task,
            level=self.settings.level,
            steps=list(self.steps),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            python=platform.python_version(),
            extra={
                "thresholds": self.settings.thresholds.to_dict(),
                "self_check": self.settings.self_check,  # the baseline holds each call's own error
                # TF32 / HF32 as the device had them (the production setting), or off (float32 in float32)
                "allow_tf32": self.settings.allow_tf32,
                **({"trend_steps": self.trend_steps} if self.trend_steps else {}),
                **({"world_size": self.world_size, "backend": self.backend} if self.world_size > 1 else {}),
            },
        )

    def close(self) -> None:
        """After the test: release the debugger's hooks, put the process-wide deterministic and TF32 / HF32
        switches back and let go of the output folder."""
        try:
            self.debugger.close()
        finally:
            try:
                self._determinism.restore()
            finally:
                self._release()

    def _release(self) -> None:
        """Let go of this run's output folder (another run of the test may take it)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)

    def finish(self, rerun: Callable[[], Any] | None = None) -> Outcome:
        """After the test body: close the debugger, then regenerate the baseline or compare against it.

        ``rerun`` runs the test body again: where the trend first differs at a step that was not dumped, it is
        called once, reseeded and with a new debugger, to dump the steps there (:mod:`pytest_msprobe.run.trend`).

        Raises :class:`BaselineError` when the baseline cannot be read or written (no verdict: an error of the
        test), :class:`MsprobeError` for the other problems (a failure).
        """
        self.debugger.close()
        if self.trend is not None and self.rank_process:  # each rank's trend, for its launcher
            write_trend(self)
        # a rank process only dumps: its launcher regenerates, compares or checks every rank's dump
        if not self.active or self.rank_process:
            if self.world_size > 1 and not self.rank_process:  # nothing to compare: the ranks' logs served
                shutil.rmtree(self.ranks_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    self.output_dir.rmdir()
            return Outcome(INACTIVE)
        if not is_dump_root(self.dump_dir):
            raise ConfigError(
                f"{self.nodeid}: no step was dumped (steps {list(self.steps)}): wrap each training step in "
                "'with msprobe.step(model):' or call msprobe.debugger.start()/stop()/step() around it"
            )
        if self.trend_steps:
            check_trend(self)
        self._check_every_step()
        if self.store is None or self.baseline_dir is None:  # the self-check alone
            return self._self_check()
        if self.session.regen:
            path = self.store.write(self.nodeid, self.dump_dir, self.manifest())
            self._drop_dump()  # the baseline is the copy
            return Outcome(REGENERATED, f"baseline written to {path}", baseline=path)
        from pytest_msprobe.report import write_reports
        from pytest_msprobe.report.advisor import advisor_text
        from pytest_msprobe.report.text import failure_message

        with self.store.reading(self.nodeid) as baseline:
            if not is_dump_root(baseline):
                found = root_holding(self.store.root, self.nodeid)
                elsewhere = (
                    f"\nits baseline is under {found}: did you mean {options.BASELINE.flag}={found}?"
                    if found
                    else ""
                )
                return Outcome(
                    MISSING,
                    f"no baseline for this test at {baseline}{elsewhere}\n"
                    f"create it on the reference device with: {self.regen_command()}",
                    baseline=baseline,
                )
            try:
                result = self.compare_dump(baseline, self.steps if self.trend_steps else None)
                if self.trend_steps:
                    result = compare_with_trend(self, result, baseline, rerun)
            except DumpFormatError as exc:  # found only now, e.g. a truncated tensor file
                which = "baseline" if is_inside(exc.path, baseline) else "dump"
                raise BaselineError(f"unusable {which}: {exc}") from None
        advisor = advisor_text(result)
        reports = write_reports(result, self.report_dir, advisor)
        if result.passed:
            self._drop_dump()
            return Outcome(PASSED, baseline=baseline, result=result, reports=reports, advisor=advisor)
        message = failure_message(result, reports, baseline, self.regen_command())
        return Outcome(FAILED, message, baseline=baseline, result=result, reports=reports, advisor=advisor)

    def compare_dump(self, baseline: Path, steps: Any = None) -> CompareResult:
        """This run's dump (its ``steps`` only, when given) compared with the baseline, as the test compares."""
        from pytest_msprobe.compare import compare

        return compare(
            self.dump_dir,
            baseline,
            thresholds=self.settings.thresholds,
            stack=True,
            # xdist already runs one test per core: a worker's compare stays in its process
            jobs=1 if os.environ.get("PYTEST_XDIST_WORKER") else None,
            self_check=self.settings.self_check,
            steps=steps,
        )

    def _self_check(self) -> Outcome:
        """The gate of a self-check without a baseline: every call of the dump judged by its own error (a
        dump folder without its self_check.json is an error: the gate would have checked part of the run)."""
        from pytest_msprobe.compare.judging import check_dump
        from pytest_msprobe.report.text import self_check_message

        try:
            result = check_dump(self.dump_dir, self.settings.thresholds)
        except DumpFormatError as exc:
            raise BaselineError(f"unusable dump: {exc}") from None
        if result.passed:
            self._drop_dump()
            return Outcome(PASSED, self_check=result)
        return Outcome(FAILED, self_check_message(result), self_check=result)

    def _check_every_step(self) -> None:
        """Every requested step (on every rank) is in the dump: a loop shorter than the steps asked for, or a
        rank that stopped early, would otherwise store or compare fewer steps than the test names."""
        from pytest_msprobe.format.layout import discover

        try:
            found = {(loc.step, loc.rank or 0) for loc in discover(self.dump_dir)}
        except DumpFormatError as exc:
            raise ConfigError(f"{self.nodeid}: the dump is incomplete: {exc}") from None
        wanted = {(s, r) for s in self.dump_steps for r in range(self.world_size)}
        lacking = sorted(wanted - found)
        if not lacking:
            return
        steps = sorted({s for s, _ in lacking})
        ran = "" if self.world_size > 1 else f" (the loop ran {self.debugger.current_step} step(s))"
        if self.world_size > 1 and len({r for _, r in lacking}) < self.world_size:
            which = ", ".join(f"step {s} of rank {r}" for s, r in lacking[:8])
        else:
            which = f"step{'s' if len(steps) > 1 else ''} {numbers(steps)}"
        raise ConfigError(
            f"{self.nodeid}: {which} never ran{ran}, though the test dumps steps {numbers(self.dump_steps)}: "
            "run every requested step or change the marker's steps="
        )

    def _drop_dump(self) -> None:
        """Remove this test's dump once it served (a pass, a regenerated baseline), unless asked to keep it."""
        if self.session.keep_dumps:
            return
        shutil.rmtree(self.dump_dir, ignore_errors=True)
        shutil.rmtree(self.ranks_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.output_dir.rmdir()  # only when empty: the compare reports stay

    def describe(self, error: MsprobeError) -> str:
        """The one-line message of a problem of this run, with the option that changes it where there is one."""
        if isinstance(error, DumpSizeError):
            return (
                f"dump of {self.nodeid} reached the {error.limit} limit at {error.row}; raise "
                f"{options.MAX_DUMP_SIZE.flag} (or the marker's {options.MAX_DUMP_SIZE.marker}=) or dump fewer "
                "steps / use task statistics"
            )
        return str(error)

    def regen_command(self) -> str:
        """The command that regenerates this test's baseline, quoted for a POSIX shell."""
        test = shlex.quote(self.nodeid)
        if not test.startswith("'"):  # shlex leaves safe ids bare; quoted, they read the same
            test = f"'{test}'"
        baseline = shlex.quote(f"{options.BASELINE.flag}={self.session.baseline}")
        return f"pytest {test} {baseline} {options.REGEN.flag}"
