"""The README's set-up commands are the ones CI runs, and the package imports without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci_lines = _command_lines((ROOT / ".ci" / "run").read_text())
    runs = [line for line in ci_lines if line.endswith("&& pytest")]
    assert len(runs) == 1, f"CI should run the tests once, by the README's command: {runs}"
    assert runs[0] in readme, f"the README no longer shows CI's test command: {runs[0]}"
    # and CI waits for the checks it ran beside the tests, failing when they failed
    after = ci_lines[ci_lines.index(runs[0]) + 1 :]
    assert any(line.startswith("wait ") for line in after) and any(line.startswith("exit") for line in after)


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, pytest_msprobe, pytest_msprobe.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
