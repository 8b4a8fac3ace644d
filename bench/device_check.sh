#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU and this repository copied there (no network needed):
#
#   1. env         the python, torch, the GPU (nvidia-smi, torch.cuda)
#   2. cuda-tests  the tests that are skipped without CUDA (pytest -k cuda over the files that check for it)
#   3. regen       the ResNet50 example's baseline written on the GPU: examples/resnet50/baselines/cuda
#   4. compare     a CUDA run of the example compared with the CPU baseline shipped with it, with the default
#                  thresholds and with TF32 on (torch.backends.cuda.matmul and cudnn allow_tf32): how many
#                  calls breach, and where the first divergence is put
#   5. bench       dump overhead on CUDA (bench/dump_overhead.py --device cuda) and the host synchronisations
#                  per dumped step (--count-syncs: CUDA's GPU trace, see SyncCounter in the bench)
#   6. compare     (again) a second CUDA run against the new CUDA baseline, without and with TF32: the device
#                  against itself, late as the less needed when time runs short
#   7. breakdown   where a dumped resnet50 step's time goes on the device (bench/dump_overhead.py --breakdown)
#
# Everything goes under one folder ($OUT when set, else ./device-check-out, or --out DIR), with summary.md
# (the figures) and one log per stage. Each stage has its own time limit and the whole run stays under 8
# minutes on one H200; a stage that fails or times out is reported and the next one runs.
#
#   bash bench/device_check.sh                  # on the GPU machine
#   bash bench/device_check.sh --dry-run        # anywhere: every stage on the CPU (--msprobe-device=cpu, small
#                                               # sizes, the repository's baselines left alone): checks the logic
#   PYTHON=/path/to/python bash bench/device_check.sh   # a given interpreter (else .venv, python3, python)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUT:-$REPO/device-check-out}"
DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run | --cpu) DRY=1 ;;
        --out) OUTDIR="$2"; shift ;;
        -h | --help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "device_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
SUMMARY="$OUTDIR/summary.md"
STAGES="$OUTDIR/stages.tsv"  # stage, status, seconds: read back into summary.md
: > "$STAGES"
START=$(date +%s)
# the limits are sized for a GPU machine; a dry run on a small CPU gets more time (DEVICE_CHECK_LIMIT_SCALE)
SCALE=${DEVICE_CHECK_LIMIT_SCALE:-$((DRY == 1 ? 4 : 1))}
BUDGET=${DEVICE_CHECK_BUDGET_S:-$((470 * SCALE))}  # the whole run, seconds

# to stderr (and the log): find_python's stdout is the path it found
say() { echo "[device-check $(($(date +%s) - START))s] $*" | tee -a "$OUTDIR/device-check.log" >&2; }

# run_stage NAME LIMIT_S COMMAND...: runs with a time limit (never past the whole run's budget), logs to NAME.log
run_stage() {
    local name="$1" limit=$(($2 * SCALE))
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        say "$name: skipped, ${left}s of the budget left"
        printf '%s\tskipped (no time left)\t0\n' "$name" >> "$STAGES"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: running (limit ${limit}s)"
    local t0 rc status
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status="ok" ;;
        124 | 137) status="timed out after ${limit}s" ;;
        *) status="exit $rc" ;;
    esac
    say "$name: $status ($(($(date +%s) - t0))s), log $OUTDIR/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" >> "$STAGES"
    return 0
}

# -- 1. the python: one that imports torch (with CUDA unless --dry-run) ---------------------------------------
find_python() {
    local candidate
    for candidate in "${PYTHON:-}" "$REPO/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
        if [ -z "$candidate" ] || [ ! -x "$candidate" ]; then continue; fi
        if "$candidate" -c "import torch" > /dev/null 2>&1; then
            if [ "$DRY" = 1 ] || "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1; then
                echo "$candidate"
                return 0
            fi
            say "$candidate imports torch, but torch.cuda.is_available() is False there"
        fi
    done
    # none: a venv from whatever pip can install here (a local wheelhouse or an index; nothing else is fetched)
    say "no python with torch (and CUDA) found: trying a venv in $OUTDIR/venv"
    if python3 -m venv --system-site-packages "$OUTDIR/venv" > /dev/null 2>&1 \
        && timeout 300 "$OUTDIR/venv/bin/pip" install -q torch torchvision numpy pytest > "$OUTDIR/venv-install.log" 2>&1 \
        && "$OUTDIR/venv/bin/python" -c "import torch" > /dev/null 2>&1; then
        echo "$OUTDIR/venv/bin/python"
        return 0
    fi
    return 1
}

PY="$(find_python)" || {
    say "FAILED: no python here imports torch (set PYTHON=/path/to/python); see $OUTDIR/venv-install.log"
    printf '# device check\n\nNo python with torch found: nothing was run (see device-check.log).\n' > "$SUMMARY"
    exit 1
}
mkdir -p "$OUTDIR/plugins"  # the TF32 plugin of stage 4 (-p tf32_on) is imported from there
export PYTHONPATH="$REPO:$OUTDIR/plugins${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
cd "$REPO" || exit 1

if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    BASELINE_OUT="$OUTDIR/baselines/cpu-dry-run"  # the repository's baselines are left alone
else
    DEVICE=cuda
    BASELINE_OUT="$REPO/examples/resnet50/baselines/cuda"
fi
say "python $PY, device $DEVICE, output $OUTDIR"

# the plugin: registered by its entry point when the package is installed, else loaded by name
PLUGIN=()
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.value.startswith('pytest_msprobe') for e in m.entry_points(group='pytest11')) else 1)" 2> /dev/null; then
    PLUGIN=(-p pytest_msprobe.pytest.plugin)
fi
PYTEST=("$PY" -m pytest -p no:cacheprovider "${PLUGIN[@]}")

# shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
run_stage env 60 bash -c '
    echo "python: $1"; "$1" -c "import sys; print(sys.version)"
    "$1" -c "
import torch
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())
if torch.cuda.is_available():
    print(\"device\", torch.cuda.get_device_name(0), \"count\", torch.cuda.device_count())
    print(\"cudnn\", torch.backends.cudnn.version(), \"matmul tf32\", torch.backends.cuda.matmul.allow_tf32,
          \"cudnn tf32\", torch.backends.cudnn.allow_tf32)
"
    command -v nvidia-smi > /dev/null && nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    for m in torchvision pytest numpy openpyxl msprobe; do "$1" -c "import $m; print(\"$m\", getattr($m, \"__version__\", \"?\"))" 2>&1 | tail -1; done
    true
' _ "$PY"

# -- 2. the tests skipped without CUDA -------------------------------------------------------------------------
# (they check torch.cuda.is_available(): tests/test_device.py, tests/dump/test_devices.py,
# tests/dump/test_distributed.py; -k cuda selects their CUDA cases)
run_stage cuda-tests 120 "${PYTEST[@]}" -rs -q -k cuda --junitxml="$OUTDIR/cuda-tests.xml" \
    tests/test_device.py tests/dump/test_devices.py tests/dump/test_distributed.py

# -- 3. the ResNet50 example's baseline, written on the device -------------------------------------------------
EXAMPLE=(examples/resnet50 -q -rs --msprobe-device="$DEVICE")
rm -rf "$BASELINE_OUT"
run_stage regen 90 "${PYTEST[@]}" "${EXAMPLE[@]}" --msprobe-baseline="$BASELINE_OUT" --msprobe-regen-baseline \
    --msprobe-output="$OUTDIR/regen-output" --junitxml="$OUTDIR/regen.xml"
if [ -d "$BASELINE_OUT" ]; then  # a copy comes back with the outputs, to be committed
    mkdir -p "$OUTDIR/baselines" && cp -r "$BASELINE_OUT" "$OUTDIR/baselines/" 2> /dev/null
fi

# -- 4. compares: against the CPU baseline and the new device one, default thresholds and TF32 on -------------
# TF32 is switched on by a tiny plugin at configure time (nothing in the plugin switches it off again);
# NVIDIA_TF32_OVERRIDE only ever forces it off, so it is not the way to turn it on.
cat > "$OUTDIR/plugins/tf32_on.py" << 'EOF'
"""Switch TF32 on for matmuls and convolutions (torch's default leaves matmuls in full float32)."""


def pytest_configure(config):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
EOF
compare() {  # compare NAME BASELINE [extra pytest args]
    local name="$1" baseline="$2"
    shift 2
    if [ ! -d "$baseline" ]; then
        say "$name: skipped, no baseline at $baseline"
        printf '%s\tskipped (no baseline)\t0\n' "$name" >> "$STAGES"
        return 0
    fi
    # exit 1 is the verdict (a breach), not a failure of the stage: the summary reads it from the junit xml
    run_stage "$name" 60 "${PYTEST[@]}" "${EXAMPLE[@]}" --msprobe-baseline="$baseline" \
        --msprobe-output="$OUTDIR/$name-output" --junitxml="$OUTDIR/$name.xml" "$@"
}
CPU_BASELINE="$REPO/examples/resnet50/baselines/cpu"
compare vs-cpu-baseline "$CPU_BASELINE"
compare vs-cpu-baseline-tf32 "$CPU_BASELINE" -p tf32_on

# -- 5. dump overhead and host synchronisations on the device --------------------------------------------------
# (each loop in a process of its own; the synchronisations counted in a second, untimed loop of that process)
if [ "$DRY" = 1 ]; then
    BENCH_SIZE=(--quick --models tiny)
else
    BENCH_SIZE=(--models tiny large resnet50)
fi
run_stage bench 150 "$PY" bench/dump_overhead.py --device "$DEVICE" "${BENCH_SIZE[@]}" --no-msprobe \
    --configs statistics_L1 md5_L1 tensor_L1 --count-syncs --write-repeats 1 --json "$OUTDIR/bench.json"
run_stage bench-mix 45 "$PY" bench/dump_overhead.py --device "$DEVICE" --quick --models large --no-msprobe \
    --configs statistics_mix --count-syncs --json "$OUTDIR/bench-mix.json"

# -- 6. the device against itself: the new baseline, a second run, with and without TF32 -----------------------
compare vs-own-baseline "$BASELINE_OUT"
compare vs-own-baseline-tf32 "$BASELINE_OUT" -p tf32_on

# -- 7. where a dumped step's time goes on the device (timers, no profiler): last, the least needed -------------
if [ "$DRY" = 1 ]; then
    BREAKDOWN=(--quick --breakdown statistics_L1 tiny)
else
    BREAKDOWN=(--breakdown statistics_L1 resnet50)
fi
run_stage breakdown 60 "$PY" bench/dump_overhead.py --device "$DEVICE" "${BREAKDOWN[@]}" \
    --json "$OUTDIR/breakdown.json"

# -- the summary -------------------------------------------------------------------------------------------------
"$PY" - "$OUTDIR" "$DEVICE" "$(($(date +%s) - START))" << 'EOF' > "$SUMMARY" 2> "$OUTDIR/summary-errors.log"
"""Reads the stages' outputs back into one markdown summary."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, device, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"# device check ({device}), {seconds} s\n")
env = out / "env.log"
if env.exists():
    print("```\n" + env.read_text().strip() + "\n```\n")
print("A compare stage exits 1 when the test fails: its verdict is in the table further down.\n")
print("| stage | status | seconds |\n|---|---|---|")
for line in (out / "stages.tsv").read_text().splitlines():
    name, status, secs = line.split("\t")
    print(f"| {name} | {status} | {secs} |")
print()


def junit(name):
    path = out / f"{name}.xml"
    if not path.exists():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, text = tag, (node.get("message") or "").strip()
        cases.append((f"{case.get('classname')}::{case.get('name')}", outcome, text))
    return cases


print("## Tests that need CUDA\n")
cases = junit("cuda-tests")
if cases is None:
    print("no result (see cuda-tests.log)\n")
else:
    for name, outcome, text in cases:
        print(f"- {outcome}: {name}" + (f" ({text[:200]})" if text else ""))
    print()

print("## ResNet50 example on the device\n")
regen = junit("regen")
baseline = out / "baselines"
print(f"- baseline regenerated: {regen[0][1] if regen else 'no result'}; written: "
      f"{', '.join(sorted(str(p.relative_to(baseline)) for p in baseline.glob('*/examples/*/*/*'))) or 'nothing'}")
print()
print("torch's defaults leave matmuls in float32 and let cuDNN convolutions use TF32 (see env above);")
print("\"TF32 on\" turns it on for matmuls too.\n")
print("| run | baseline | verdict | calls breaching / compared | first divergence |")
print("|---|---|---|---|---|")
for name, what in (
    ("vs-cpu-baseline", "CPU (shipped), default thresholds"),
    ("vs-cpu-baseline-tf32", "CPU (shipped), TF32 on"),
    ("vs-own-baseline", "this device's, default thresholds"),
    ("vs-own-baseline-tf32", "this device's, TF32 on"),
):
    cases = junit(name)
    summaries = sorted((out / f"{name}-output").rglob("summary.json"))
    verdict = cases[0][1] if cases else "no result"
    breach = first = ""
    if summaries:
        doc = json.loads(summaries[0].read_text())
        c = doc.get("counts") or {}
        breach = f"{c.get('apis_error')} / {c.get('apis')} calls ({c.get('error')} / {c.get('rows')} rows)"
        fd = doc.get("first_divergence")
        first = "none"
        if fd:
            where = fd.get("api") or fd.get("name") or fd.get("kind")
            first = f"{where} (step {fd.get('step')}): {str(fd.get('reason') or '')[:160]}"
    elif cases and cases[0][2]:
        first = cases[0][2][:200]
    print(f"| {name} | {what} | {verdict} | {breach} | {first} |")
print()

print("## Dump overhead and host synchronisations\n")
for name in ("bench", "bench-mix"):
    log = out / f"{name}.log"
    if not log.exists():
        continue
    text = log.read_text()
    tables = text[text.find("\n|") + 1 :] if "\n|" in text else f"(no table: see {name}.log)\n"
    print(tables.strip() + "\n")

print("## Where a dumped step's time goes\n")
log = out / "breakdown.log"
print(log.read_text().strip() + "\n" if log.exists() else "no result (the stage did not run)\n")
EOF
say "summary: $SUMMARY"
cat "$SUMMARY"
