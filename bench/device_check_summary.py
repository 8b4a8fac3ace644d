"""The summary of ``bench/device_check.sh``: its stages' outputs read back into one markdown page.

    python bench/device_check_summary.py OUT DEVICE SECONDS > OUT/summary.md

OUT holds what the stages left: ``stages.tsv`` (stage, status, seconds), ``env.log``, each pytest stage's junit
file ``NAME.xml`` and compare output ``NAME-output/.../summary.json``, each fault stage's firings
``NAME-fired.json`` (bench/faults_plugin.py's log) with its line in ``faults.tsv`` (stage, model, fault), and the
bench's logs. A stage that left nothing is reported as such: the page is written whatever ran.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# the compares of the ResNet50 example: (stage, baseline and settings)
RESNET50_RUNS = (
    ("vs-cpu-baseline", "CPU (shipped), default thresholds"),
    ("vs-cpu-baseline-tf32", "CPU (shipped), TF32 on"),
    ("vs-own-baseline", "this device's, default thresholds"),
    ("vs-own-baseline-tf32", "this device's, TF32 on"),
)


def junit(out: Path, name: str) -> list[tuple[str, str, str]] | None:
    """(test, outcome, message) of each test case of stage ``name``, None without its junit file."""
    path = out / f"{name}.xml"
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:  # cut short by the stage's time limit
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    cases = []
    for case in suite.iter("testcase"):
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, text = tag, (node.get("message") or "").strip()
        cases.append((f"{case.get('classname')}::{case.get('name')}", outcome, text))
    return cases


def compare_summary(out: Path, name: str) -> dict[str, Any] | None:
    """The compare's summary.json of stage ``name`` (its first test's), None when it wrote none."""
    found = sorted((out / f"{name}-output").rglob("summary.json"))
    found = [p for p in found if p.parent.name == "compare"] or found
    if not found:
        return None
    try:
        doc: dict[str, Any] = json.loads(found[0].read_text())
    except (OSError, ValueError):
        return None
    return doc


def breaching(doc: dict[str, Any]) -> str:
    c = doc.get("counts") or {}
    return f"{c.get('apis_error')} / {c.get('apis')} calls ({c.get('error')} / {c.get('rows')} rows)"


def divergence_at(fd: dict[str, Any]) -> str:
    """Where a first divergence is: ``Functional.conv2d.30.forward (step 0)``, ``parameter W (before step 1)``."""
    if fd.get("api"):
        return f"{fd['api']} (step {fd.get('step')})"
    if fd.get("name"):
        return f"{fd.get('kind') or 'name'} {fd['name']} ({fd.get('where') or 'step ' + str(fd.get('step'))})"
    return f"{fd.get('kind') or '?'} (step {fd.get('step')})"


def first_divergence(doc: dict[str, Any]) -> str:
    fd = doc.get("first_divergence")
    if not fd:
        return "none"
    return f"{divergence_at(fd)}: {str(fd.get('reason') or '')[:160]}"


def verdict_row(out: Path, name: str) -> tuple[str, str, str]:
    """(verdict, calls breaching, first divergence) of one compare stage."""
    cases = junit(out, name)
    doc = compare_summary(out, name)
    verdict = cases[0][1] if cases else "no result"
    if doc is not None:
        return verdict, breaching(doc), first_divergence(doc)
    return verdict, "", cases[0][2][:200] if cases and cases[0][2] else ""


def fault_stages(out: Path) -> list[tuple[str, str, str]]:
    """(stage, model, fault) of the fault stages, in the order they ran; fault "" for a clean run."""
    path = out / "faults.tsv"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            rows.append((parts[0], parts[1], parts[2]))
    return rows


def fired_at(out: Path, name: str) -> list[dict[str, Any]] | None:
    path = out / f"{name}-fired.json"
    try:
        fired: list[dict[str, Any]] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return fired


def named_where_made(fault: str, fired: list[dict[str, Any]] | None, doc: dict[str, Any] | None) -> str:
    """Whether the first divergence is where the fault was made: its call at the first step it fired (op,
    backward), or the weight: its update at the first step it fired, or the weight itself before the next step
    (optimizer); "no" names what was named instead elsewhere in the row."""
    if not fault:
        return ""
    if not fired or doc is None:
        return "no result"
    fd = doc.get("first_divergence") or {}
    kind, _, target = fault.partition(":")
    if kind == "optimizer":
        update = fd.get("api") == f"Optimizer.{target}.0.forward" and fd.get("step") == fired[0]["step"]
        weight = fd.get("kind") == "parameter" and fd.get("name") == target
        return "yes" if update or weight else "no"
    first = fired[0]
    return "yes" if fd.get("api") == first["at"] and fd.get("step") == first["step"] else "no"


def fault_table(out: Path) -> list[str]:
    lines = [
        "| model | run | fault (bench/faults_plugin.py) | fired at | verdict | calls breaching / compared | "
        "first divergence | named where made |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, model, fault in fault_stages(out):
        verdict, breach, first = verdict_row(out, name)
        fired = fired_at(out, name)
        if not fault:
            where = ""
        elif fired is None:
            where = "no log"
        elif not fired:
            where = "never fired"
        else:
            steps = sorted({f["step"] for f in fired})
            where = f"{fired[0]['at']}, steps {', '.join(map(str, steps))}"
        named = named_where_made(fault, fired, compare_summary(out, name))
        lines.append(
            f"| {model} | {name} | {fault or 'none (clean)'} | {where} | {verdict} | {breach} | {first} | {named} |"
        )
    return lines


def bench_tables(out: Path, name: str) -> str | None:
    log = out / f"{name}.log"
    if not log.exists():
        return None
    text = log.read_text()
    return text[text.find("\n|") + 1 :].strip() if "\n|" in text else f"(no table: see {name}.log)"


def render(out: Path, device: str, seconds: str) -> str:
    lines = [f"# device check ({device}), {seconds} s", ""]
    env = out / "env.log"
    if env.exists():
        lines += ["```", env.read_text().strip(), "```", ""]
    lines += ["A compare stage exits 1 when the test fails: its verdict is in the tables further down.", ""]
    lines += ["| stage | status | seconds |", "|---|---|---|"]
    stages = out / "stages.tsv"
    for line in stages.read_text().splitlines() if stages.exists() else []:
        name, status, secs = line.split("\t")
        lines.append(f"| {name} | {status} | {secs} |")
    lines.append("")

    lines += ["## Tests that need CUDA", ""]
    cases = junit(out, "cuda-tests")
    if cases is None:
        lines.append("no result (see cuda-tests.log)")
    else:
        lines += [
            f"- {outcome}: {name}" + (f" ({text[:200]})" if text else "") for name, outcome, text in cases
        ]
    lines.append("")

    lines += ["## ResNet50 example on the device", ""]
    regen = junit(out, "regen")
    baseline = out / "baselines"
    written = ", ".join(sorted(str(p.relative_to(baseline)) for p in baseline.glob("*/examples/*/*/*")))
    lines += [
        f"- baseline regenerated: {regen[0][1] if regen else 'no result'}; written: {written or 'nothing'}",
        "",
        "The msprobe fixture computes float32 math in float32 (TF32 off) unless a test allows TF32; "
        '"TF32 on" switches it on for matmuls and cuDNN convolutions and keeps it with --msprobe-allow-tf32.',
        "",
        "| run | baseline | verdict | calls breaching / compared | first divergence |",
        "|---|---|---|---|---|",
    ]
    for name, what in RESNET50_RUNS:
        verdict, breach, first = verdict_row(out, name)
        lines.append(f"| {name} | {what} | {verdict} | {breach} | {first} |")
    lines.append("")

    lines += [
        "## Faults on the device against the CPU baselines",
        "",
        "Each model run on the device and compared with its CPU baseline (default thresholds), clean and with one",
        "fault of bench/faults_plugin.py: op (the call's output x (1 + 1e-3)), backward (its backward's",
        'gradients x (1 + 1e-2)), optimizer (1e-3 x std added to one weight after each optimizer step). "fired',
        'at" is where the fault was made (its log), "named where made" whether the first divergence is there.',
        "",
        *fault_table(out),
        "",
    ]

    lines += ["## Dump overhead and host synchronisations", ""]
    for name in ("bench", "bench-mix"):
        tables = bench_tables(out, name)
        if tables is not None:
            lines += [tables, ""]

    lines += ["## How the device rounds TF32 operands (bench/tf32_rounding.py)", ""]
    log = out / "tf32-rounding.log"
    lines += [log.read_text().strip() if log.exists() else "no result (the stage did not run)", ""]

    lines += ["## Where a dumped step's time goes", ""]
    log = out / "breakdown.log"
    lines.append(log.read_text().strip() if log.exists() else "no result (the stage did not run)")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: device_check_summary.py OUT DEVICE SECONDS\n")
        return 2
    sys.stdout.write(render(Path(argv[0]), argv[1], argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
