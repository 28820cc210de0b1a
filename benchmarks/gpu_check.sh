#!/usr/bin/env bash
# GPU check: every CUDA path of funcaccel, in one run of a few minutes.
#
# Install first (this script installs nothing): the CUDA build of torch, then
#     pip install -e '.[dev]'
# Run from anywhere (it changes to the repository root itself):
#     bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to ./gpu-check-out
#
# Steps run one after another, each under its own time limit (so a hang ends that
# step only); a failure does not stop the ones after it. The run is expected to
# take 2-4 minutes on one GPU (an estimate: it has not run on one yet); the limits
# add up to just under 10 minutes at worst (more with a second GPU).
#
#   env                 nvidia-smi, torch / CUDA / NCCL versions, `python -m funcaccel env`
#   cuda-available      whether torch sees a GPU (without one, the GPU steps are skipped)
#   test_cuda           python -m pytest tests/test_cuda.py
#   cuda-tests-elsewhere  the CUDA tests of other files: -k "cuda or gpu" over tests/
#                       (every test that skips without CUDA has "cuda" or "gpu" in its
#                       id; a few CPU tests whose ids mention CUDA run too)
#   bench_loop-{no,bf16,fp16}  benchmarks/bench_loop.py --device cuda, small sizes
#   bench_mesh_memory   benchmarks/bench_mesh_memory.py --cuda, small sizes; it needs
#                       2 GPUs (NCCL refuses two ranks on one), so it is skipped on one
# A pytest step also fails when a test in it skipped for lack of CUDA: on a GPU
# machine that test would not have exercised its path.
#
# Everything goes under OUT_DIR: <step>.log for each step, the pytest steps' JUnit
# XML, and summary.txt (each step's name, status, exit status and seconds), which is
# also printed last, after the tail of the log of each step that failed.
#
# Exit status: 0 every step passed (skipped steps aside); 1 a step failed or timed
# out; 2 a usage error; 3 torch sees no CUDA device, so only env ran (and nothing
# else failed). GPU_CHECK_FORCE=1 runs the GPU steps anyway, to try this script on a
# machine without a GPU (they then fail or skip). PYTHON picks the interpreter
# (default: python).
#
# Not yet run on a GPU (see benchmarks/README.md, "GPU check").

# The step functions below are called through run_step, which shellcheck cannot see.
# shellcheck disable=SC2317
set -u -o pipefail

if (($# > 1)); then
    echo "usage: bash benchmarks/gpu_check.sh [OUT_DIR]" >&2
    exit 2
fi
out=${1:-./gpu-check-out}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python}

names=()
statuses=()
codes=()
seconds=()
notes=()

now() { date +%s.%N; }

record() { # record NAME STATUS CODE SECONDS NOTE
    names+=("$1")
    statuses+=("$2")
    codes+=("$3")
    seconds+=("$4")
    notes+=("$5")
    printf '%-22s %-8s exit %-4s %7s s  %s\n' "$1" "$2" "$3" "$4" "$5"
}

# run_step NAME COMMAND...: run COMMAND (a program or a function of this script)
# with its output in OUT_DIR/NAME.log and record how it ended. A function may
# leave a note for the summary in the file named by $note_file.
run_step() {
    local name=$1 start rc status elapsed note
    shift
    note_file="$out/.$name.note"
    : >"$note_file"
    start=$(now)
    {
        printf '$ %s\n' "$*"
        "$@"
    } >"$out/$name.log" 2>&1
    rc=$?
    elapsed=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    case $name:$rc in
        cuda-available:1) status=no-cuda ;; # an answer: the exit status says it (3)
        *:0) status=ok ;;
        *:124 | *:137) status=timeout ;;
        *) status=FAIL ;;
    esac
    note=$(cat "$note_file")
    rm -f "$note_file"
    record "$name" "$status" "$rc" "$elapsed" "$note"
}

skip_step() { # skip_step NAME REASON
    record "$1" skip - 0.0 "$2"
}

env_step() {
    local rc=0
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi || echo "nvidia-smi exited $?"
    else
        echo "nvidia-smi: not on PATH"
    fi
    timeout 30 "$PYTHON" - <<'PY' || rc=1
import importlib.metadata
import sys

import torch
import torch.distributed as dist

print("python", sys.version.split()[0])
print("torch", torch.__version__, "| built with CUDA", torch.version.cuda)
print("CUDA available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    capability = ".".join(map(str, torch.cuda.get_device_capability(i)))
    print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, sm {capability}")
if torch.cuda.is_available():
    print("bf16 supported", torch.cuda.is_bf16_supported())
try:
    version = torch.cuda.nccl.version()
    shown = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    print("NCCL", shown)
except Exception as error:  # a build without NCCL
    print("NCCL: none in this torch build:", type(error).__name__, error)
print("NCCL backend for torch.distributed", dist.is_available() and dist.is_nccl_available())
for name in ("funcaccel", "deepspeed", "numpy"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "not installed")
PY
    timeout 30 "$PYTHON" -m funcaccel env || rc=1
    return "$rc"
}

cuda_available_step() {
    timeout 30 "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
    local rc=$?
    if ((rc == 1)); then
        echo "torch sees no CUDA device" | tee "$note_file"
    fi
    return "$rc"
}

# pytest_step LIMIT_S XML PYTEST_ARGS...: pytest, then a note from its JUnit XML.
pytest_step() {
    local limit=$1 xml=$2 rc
    shift 2
    timeout --kill-after=15 "$limit" "$PYTHON" -m pytest -v -p no:cacheprovider -rs \
        --durations=10 --junitxml="$xml" "$@"
    rc=$?
    if [[ -f $xml ]]; then
        "$PYTHON" - "$xml" "$note_file" <<'PY'
import collections
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
outcome = collections.Counter()
reasons = collections.Counter()
for case in cases:
    kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    outcome[kinds[0] if kinds else "passed"] += 1
    for child in case:
        if child.tag == "skipped":
            reasons[child.get("message", "")] += 1
text = ", ".join(f"{n} {k}" for k, n in sorted(outcome.items()))
no_cuda = sum(n for why, n in reasons.items() if "needs cuda" in why.lower() or "needs a cuda" in why.lower())
if no_cuda:
    text += f"; {no_cuda} skipped for lack of CUDA"
print(text)
for why, n in reasons.most_common():
    print(f"skipped {n}x: {why}")
with open(sys.argv[2], "a") as note:
    note.write(text)
sys.exit(3 if no_cuda else 0)
PY
        if (($? == 3 && rc == 0)); then
            rc=1 # a CUDA path was not exercised
        fi
    fi
    return "$rc"
}

bench_loop_step() { # bench_loop_step PRECISION
    timeout --kill-after=15 40 "$PYTHON" benchmarks/bench_loop.py --device cuda \
        --mixed-precision "$1" --repeats 5 --micro-batches 32 --no-accelerate
}

bench_mesh_step() {
    timeout --kill-after=15 120 "$PYTHON" benchmarks/bench_mesh_memory.py --cuda \
        --worlds 2 --hidden 512 --layers 2 --steps 2
}

gpu_count() {
    timeout 30 "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

started=$(now)
echo "GPU check: outputs in $out"
run_step env env_step
cat "$out/env.log"
echo
run_step cuda-available cuda_available_step
have_cuda=$((codes[${#codes[@]} - 1] == 0))
if ((have_cuda)) || [[ ${GPU_CHECK_FORCE:-0} == 1 ]]; then
    run_step test_cuda pytest_step 170 "$out/test_cuda.xml" tests/test_cuda.py
    run_step cuda-tests-elsewhere pytest_step 100 "$out/cuda-tests-elsewhere.xml" \
        -k "cuda or gpu" --ignore=tests/test_cuda.py tests
    for precision in no bf16 fp16; do
        run_step "bench_loop-$precision" bench_loop_step "$precision"
    done
    gpus=$(gpu_count)
    if ((gpus >= 2)); then
        run_step bench_mesh_memory bench_mesh_step
    else
        skip_step bench_mesh_memory "needs 2 GPUs for NCCL; $gpus visible"
    fi
else
    for name in test_cuda cuda-tests-elsewhere bench_loop-no bench_loop-bf16 \
        bench_loop-fp16 bench_mesh_memory; do
        skip_step "$name" "no CUDA"
    done
fi
total=$(awk -v a="$started" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')

failed=0
for i in "${!names[@]}"; do
    case ${statuses[i]} in
        FAIL | timeout)
            failed=1
            echo
            echo "---- ${names[i]} ${statuses[i]} (exit ${codes[i]}): last lines of $out/${names[i]}.log"
            tail -n 40 "$out/${names[i]}.log"
            ;;
    esac
done

{
    echo
    echo "GPU check summary ($out)"
    printf '%-22s %-8s %-5s %8s  %s\n' step status exit seconds note
    for i in "${!names[@]}"; do
        printf '%-22s %-8s %-5s %8s  %s\n' "${names[i]}" "${statuses[i]}" "${codes[i]}" \
            "${seconds[i]}" "${notes[i]}"
    done
    printf '%-22s %-8s %-5s %8s\n' total "" "" "$total"
} | tee "$out/summary.txt"

if ((failed)); then
    exit 1
elif ((!have_cuda)); then
    exit 3
fi
exit 0
