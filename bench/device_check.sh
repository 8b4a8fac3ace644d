#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU and this repository copied there (no network needed):
#
#   1. env         the python, torch, the GPU (nvidia-smi, torch.cuda)
#   1b. tf32-rounding  which rounding the device's TF32 matmuls and convolutions do (bench/tf32_rounding.py): the
#                  self-check's emulation of a declared TF32 policy rounds to nearest, ties to even
#   2. cuda-tests  the tests that are skipped without CUDA (pytest -k cuda over the files that check for it:
#                  devices, ranks, the statistics' peak memory, the checklist's transfers, host asks)
#   3. regen       the ResNet50 example's baseline written on the GPU: examples/resnet50/baselines/cuda
#   4. compare     a CUDA run of the example compared with the CPU baseline shipped with it, with the fixture's
#                  default (float32 math in float32: TF32 off) and with TF32 on (torch.backends.cuda.matmul and
#                  cudnn allow_tf32, kept by --msprobe-allow-tf32): how many calls breach, and where the first
#                  divergence is put
#   5. faults      the device against the CPU baselines with one fault of bench/faults_plugin.py each (op,
#                  backward, optimizer): ResNet50 (its clean run is stage 4's), then examples/transformer clean
#                  and with the same three faults; each fault's firings logged beside the compare's verdict
#   6. bench       dump overhead on CUDA (bench/dump_overhead.py --device cuda) and the host synchronisations
#                  per dumped step (--count-syncs: CUDA's GPU trace, see SyncCounter in the bench)
#   6b. launches   the operators a dumped step launches per recorded tensor (bench/launch_count.py)
#   7. compare     (again) a second CUDA run against the new CUDA baseline, without and with TF32: the device
#                  against itself, late as the less needed when time runs short
#   8. breakdown   where a dumped resnet50 step's time goes on the device (bench/dump_overhead.py --breakdown)
#
# Everything goes under one folder ($OUT when set, else ./device-check-out, or --out DIR), with summary.md
# (the figures, written by bench/device_check_summary.py) and one log per stage. Each stage has its own time
# limit and the whole run stays under 8 minutes on one H200; a stage that fails or times out is reported and
# the next one runs.
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
        -h | --help) sed -n '2,27p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "device_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
SUMMARY="$OUTDIR/summary.md"
STAGES="$OUTDIR/stages.tsv"  # stage, status, seconds: read back into summary.md
FAULTS="$OUTDIR/faults.tsv"  # stage, model, fault ("" for a clean run): the fault table of summary.md
: > "$STAGES"
: > "$FAULTS"
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
# bench/: the faults plugin of stage 5 (-p faults_plugin)
export PYTHONPATH="$REPO:$REPO/bench:$OUTDIR/plugins${PYTHONPATH:+:$PYTHONPATH}"
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

# -- 1b. how the device rounds TF32 operands (the self-check's emulation rounds to nearest, ties to even) -----
run_stage tf32-rounding 30 "$PY" bench/tf32_rounding.py --json "$OUTDIR/tf32_rounding.json"

# -- 2. the tests skipped without CUDA -------------------------------------------------------------------------
# (they check torch.cuda.is_available(): tests/test_device.py, tests/dump/test_devices.py,
# tests/dump/test_distributed.py; -k cuda selects their CUDA cases)
run_stage cuda-tests 120 "${PYTEST[@]}" -rs -q -k cuda --junitxml="$OUTDIR/cuda-tests.xml" \
    tests/test_device.py tests/dump/test_devices.py tests/dump/test_distributed.py tests/dump/test_stats.py \
    tests/dump/test_checklist_transfers.py tests/dump/test_host_syncs.py

# -- 3. the ResNet50 example's baseline, written on the device -------------------------------------------------
EXAMPLE=(examples/resnet50 -q -rs --msprobe-device="$DEVICE")
rm -rf "$BASELINE_OUT"
run_stage regen 90 "${PYTEST[@]}" "${EXAMPLE[@]}" --msprobe-baseline="$BASELINE_OUT" --msprobe-regen-baseline \
    --msprobe-output="$OUTDIR/regen-output" --junitxml="$OUTDIR/regen.xml"
if [ -d "$BASELINE_OUT" ]; then  # a copy comes back with the outputs, to be committed
    mkdir -p "$OUTDIR/baselines" && cp -r "$BASELINE_OUT" "$OUTDIR/baselines/" 2> /dev/null
fi

# -- 4. compares: against the CPU baseline and the new device one, default thresholds and TF32 on -------------
# TF32 is switched on by a tiny plugin at configure time, and --msprobe-allow-tf32 keeps it on in the test (the
# fixture's default switches it off for the test); NVIDIA_TF32_OVERRIDE only ever forces it off.
cat > "$OUTDIR/plugins/tf32_on.py" << 'EOF'
"""Switch TF32 on for matmuls and convolutions (torch's default leaves matmuls in full float32)."""


def pytest_configure(config):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
EOF
compare() {  # compare NAME BASELINE [extra pytest args]: the ResNet50 example on the device against BASELINE
    local name="$1" baseline="$2"
    shift 2
    model_compare "$name" 60 "$baseline" examples/resnet50 "" "$@"
}
# model_compare NAME LIMIT BASELINE EXAMPLE_DIR FAULT [extra pytest args]: EXAMPLE_DIR's test on the device against
# BASELINE, with FAULT of bench/faults_plugin.py injected unless it is "" (its firings logged to NAME-fired.json)
model_compare() {
    local name="$1" limit="$2" baseline="$3" example="$4" fault="$5"
    shift 5
    if [ ! -d "$baseline" ]; then
        say "$name: skipped, no baseline at $baseline"
        printf '%s\tskipped (no baseline)\t0\n' "$name" >> "$STAGES"
        return 0
    fi
    local inject=(env)  # the fault's variables reach this stage's pytest only
    if [ -n "$fault" ]; then
        inject+=(INJECT_FAULT="$fault" INJECT_FAULT_LOG="$OUTDIR/$name-fired.json")
        set -- -p faults_plugin "$@"
    fi
    # exit 1 is the verdict (a breach), not a failure of the stage: the summary reads it from the junit xml
    run_stage "$name" "$limit" "${inject[@]}" "${PYTEST[@]}" "$example" -q -rs --msprobe-device="$DEVICE" \
        --msprobe-baseline="$baseline" --msprobe-output="$OUTDIR/$name-output" --junitxml="$OUTDIR/$name.xml" "$@"
}
CPU_BASELINE="$REPO/examples/resnet50/baselines/cpu"
compare vs-cpu-baseline "$CPU_BASELINE"
printf 'vs-cpu-baseline\tresnet50\t\n' >> "$FAULTS"  # the clean row of the fault table
compare vs-cpu-baseline-tf32 "$CPU_BASELINE" -p tf32_on --msprobe-allow-tf32

# -- 5. the device against the CPU baselines, with one injected fault each ---------------------------------------
# (bench/faults_plugin.py: op = the call's output x (1 + 1e-3), backward = its backward's gradients x (1 + 1e-2),
# optimizer = 1e-3 x std added to the weight after each optimizer.step(); mid-network calls and weights)
fault_compare() {  # fault_compare NAME MODEL LIMIT BASELINE EXAMPLE_DIR FAULT ("" for a clean run)
    printf '%s\t%s\t%s\n' "$1" "$2" "$6" >> "$FAULTS"
    model_compare "$1" "$3" "$4" "$5" "$6"
}
fault_compare r50-op resnet50 60 "$CPU_BASELINE" examples/resnet50 op:Functional.conv2d.30              # layer3.1.conv3
fault_compare r50-backward resnet50 60 "$CPU_BASELINE" examples/resnet50 backward:Functional.conv2d.32  # layer3.2.conv2
fault_compare r50-optimizer resnet50 60 "$CPU_BASELINE" examples/resnet50 optimizer:layer3.3.conv2.weight
TR_BASELINE="$REPO/examples/transformer/baselines/cpu"
fault_compare tr-clean transformer 45 "$TR_BASELINE" examples/transformer ""
fault_compare tr-op transformer 45 "$TR_BASELINE" examples/transformer op:Functional.linear.8  # block 1's v
fault_compare tr-backward transformer 45 "$TR_BASELINE" examples/transformer backward:Functional.layer_norm.2  # block 1's ln1
fault_compare tr-optimizer transformer 45 "$TR_BASELINE" examples/transformer optimizer:blocks.0.fc1.weight

# -- 6. dump overhead and host synchronisations on the device --------------------------------------------------
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
# the operators (kernel launches) a dumped step adds per recorded tensor
run_stage launches 45 "$PY" bench/launch_count.py --device "$DEVICE" --models tiny large --tasks statistics \
    --json "$OUTDIR/launches.json"

# -- 7. the device against itself: the new baseline, a second run, with and without TF32 -----------------------
compare vs-own-baseline "$BASELINE_OUT"
compare vs-own-baseline-tf32 "$BASELINE_OUT" -p tf32_on --msprobe-allow-tf32

# -- 8. where a dumped step's time goes on the device (timers, no profiler): last, the least needed -------------
if [ "$DRY" = 1 ]; then
    BREAKDOWN=(--quick --breakdown statistics_L1 tiny)
else
    BREAKDOWN=(--breakdown statistics_L1 resnet50)
fi
run_stage breakdown 60 "$PY" bench/dump_overhead.py --device "$DEVICE" "${BREAKDOWN[@]}" \
    --json "$OUTDIR/breakdown.json"

# -- the summary -------------------------------------------------------------------------------------------------
"$PY" bench/device_check_summary.py "$OUTDIR" "$DEVICE" "$(($(date +%s) - START))" > "$SUMMARY" \
    2> "$OUTDIR/summary-errors.log"
say "summary: $SUMMARY"
cat "$SUMMARY"
