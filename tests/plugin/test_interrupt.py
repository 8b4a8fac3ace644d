"""Ctrl-C at a random moment of a dumped step: pytest stops as interrupted, and nothing of the plugin is left
half done (no traceback, every file whole, the baseline untouched)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_sources import BASE

pytestmark = pytest.mark.slow  # many interrupted pytest runs

ARGS = [*BASE, "-p", "no:xdist"]

BODY = """
def test_train(msprobe):
    import os, signal, threading, time
    at = os.environ.get("INTERRUPT_AT")
    main = threading.get_ident()
    if at is not None:
        threading.Timer(float(at), signal.pthread_kill, (main, signal.SIGINT)).start()
    start = time.perf_counter()
    train(msprobe, steps=3)
    print(f"TRAINED IN {time.perf_counter() - start:.6f}")
    if at is not None:
        time.sleep(10)  # the interrupt is due before this ends
"""


def _run(pytester: pytest.Pytester, at: float | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "INTERRUPT_AT"}
    if at is not None:
        env["INTERRUPT_AT"] = f"{at:.6f}"
    return subprocess.run(
        [sys.executable, "-m", "pytest", *ARGS, "-s", *args],
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _files_whole(folder: Path) -> None:
    for path in folder.rglob("*"):
        assert not path.name.startswith(".") and ".tmp" not in path.name, f"left behind: {path}"
        if path.suffix == ".json":
            json.loads(path.read_text())  # complete, never half-written


@pytest.mark.parametrize(
    ("marker", "seed"),
    [
        ('@pytest.mark.msprobe(task="statistics", level="mix", steps=[0, 1, 2])', 1),
        ('@pytest.mark.msprobe(task="tensor", level="L1", steps=[0, 1, 2])', 2),
    ],
    ids=["statistics-mix", "tensor-L1"],  # md5: as statistics here (test_interrupts.py runs it in-process)
)
def test_ctrl_c_at_random_moments_of_dumped_steps_stops_the_session_cleanly(
    pytester: pytest.Pytester, train_source: str, marker: str, seed: int
) -> None:
    source = train_source.replace("MARKER", marker)
    source = source[: source.index("def test_train(msprobe):")] + BODY
    pytester.makepyfile(test_train=source)
    regen = _run(pytester, None, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    assert regen.returncode == 0, regen.stdout + regen.stderr
    baseline = pytester.path / "bl"
    before = {p: p.read_bytes() for p in baseline.rglob("*") if p.is_file()}
    took = float(regen.stdout.split("TRAINED IN ")[1].split()[0])
    rng = random.Random(seed)
    for attempt in range(2):  # a compare, a regeneration
        at = rng.uniform(0.0, took)
        args = ["--msprobe-baseline=bl", "--msprobe-keep-dumps"]
        if attempt % 2:
            args.append("--msprobe-regen-baseline")
        run = _run(pytester, at, *args)
        out = run.stdout + run.stderr
        where = f"interrupt at {at:.4f} s of {took:.4f} s ({args}):\n{out}"
        assert run.returncode == pytest.ExitCode.INTERRUPTED, where
        assert "KeyboardInterrupt" in out, where
        for bad in ("Traceback", "INTERNALERROR", "DumpError", "during handling", "Exception ignored"):
            assert bad not in out, where
        _files_whole(pytester.path / "msprobe-output")
        after = {p: p.read_bytes() for p in baseline.rglob("*") if p.is_file()}
        assert after == before, "an interrupted run changed the baseline"
