#!/usr/bin/env bash
# The GPU check: every CUDA path of wtcore, run in one go on a machine with a GPU, each step
# bounded by `timeout`, all in under 8 minutes, ending with one summary table.
#
# Steps (docs/benchmarks.md, "The GPU check"):
#   env         python, torch, CUDA as this torch sees it, GPUs, the engines installed
#   gpu-tests   every gpu-marked test not run by a step below
#   cuda-ipc    the ipc engine's CUDA IPC round trip between two processes (tests/ipc/test_cuda.py)
#   nccl-procs  the nccl engine between processes: one GPU (gloo over CUDA tensors), and the
#               NCCL transport between two GPUs when there are two, whole-tensor and sharded
#               rounds (tests/integration/test_gpu_processes.py)
#   bench-nccl  wtcore bench --device cuda, nccl engine, HTTP receivers, JSON record
#   bench-ipc   the same for the ipc engine
#   bench-tcp   the tcp engine, 128 MiB, the models on the GPU (both ends stage in host memory)
#   bench-mooncake  the mooncake engine with the model on the GPU (CPU staging, TCP), 128 MiB,
#               against its bare read
#   bench-staged  staged rounds (nccl, 2 receivers, models on the GPU) in turns with classic
#               ones: each receiver's paused time against the round's
#
# Usage: scripts/gpu-check.sh [--dry-run | --force] [--out DIR] [--wheels DIR]
#   --out DIR   where logs, JSON records and summary.txt go (default: $OUT if set, else
#               gpu-check-out)
#   --wheels DIR  install DIR's wheels (scripts/gpu-wheels.sh makes them) into a temporary
#               folder first, without the network: on a GPU machine whose Python has a CUDA
#               torch but not wtcore, they bring the engines' entry points and their binary
#               needs (Mooncake, pybase64); the checkout's own code still goes first
#   --dry-run   list the steps and exit 0 (also what happens when this torch sees no CUDA)
#   --force     run the steps even without CUDA (to check the script itself: the GPU tests
#               then skip and the benches fail with their one-line error)
#
# Python: .venv/bin/python if it runs, else $PYTHON or python3. The checkout goes first on
# PYTHONPATH, so the code under test is this one even if the venv's editable installs point
# elsewhere (a copy of the repository with the venv carried along). Exit status: 0 when every
# step passed or on a dry run, 1 otherwise.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

DRY=0
FORCE=0
WHEELS=
OUT_DIR=${OUT:-gpu-check-out}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --force) FORCE=1 ;;
        --out) OUT_DIR=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

NWHEELS=0
[[ -z "$WHEELS" ]] || NWHEELS=$(compgen -G "$WHEELS/*.whl" | wc -l)
if [[ -n "$WHEELS" && $NWHEELS -eq 0 ]]; then
    echo "gpu-check: --wheels $WHEELS: no .whl files there (scripts/gpu-wheels.sh makes them)" >&2
    exit 2
fi

if [[ -x .venv/bin/python ]] && .venv/bin/python -c '' 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=${PYTHON:-python3}
fi
PYTHONPATH="$ROOT$(printf ':%s' "$ROOT"/plugins/*/)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1

# What this python's torch sees: "torch <version>, CUDA available: <bool>, <n> GPU(s)".
TORCH_LINE=$(timeout 120 "$PY" -c '
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, {n} GPU(s)"
      + (f" ({names})" if n else ""))
' 2>/dev/null) || TORCH_LINE="torch not importable by $PY"
SMI=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | head -8 | tr '\n' ';')

GPU_FILES=$(grep -rlE 'pytest\.mark\.gpu([^"A-Za-z_]|$)' tests --include='test_*.py' | sort \
    | grep -v -e '^tests/ipc/test_cuda.py$' -e '^tests/integration/test_gpu_processes.py$' \
    | xargs)
GPU_FILES=${GPU_FILES:-tests/nccl/test_gpu_nccl.py}
BENCH=(-m wtcore.cli bench --device cuda --client http --receivers 1 --size 256MiB
       --tensors 100 --dtype bfloat16 --rounds 3 --baselines peers --timeout 60)
PYTEST=(-m pytest -q -m gpu)

# name | seconds | command (run with bash -c after the python is substituted)
STEPS=(
    "env|30|$PY -m wtcore.cli plugins"
    "gpu-tests|80|$PY ${PYTEST[*]} $GPU_FILES"
    "cuda-ipc|60|$PY ${PYTEST[*]} tests/ipc/test_cuda.py"
    "nccl-procs|80|$PY ${PYTEST[*]} tests/integration/test_gpu_processes.py"
    "bench-nccl|45|$PY ${BENCH[*]} --backend nccl --json $OUT_DIR/bench-nccl-cuda.json"
    "bench-ipc|45|$PY ${BENCH[*]} --backend ipc --json $OUT_DIR/bench-ipc-cuda.json"
    "bench-tcp|45|$PY ${BENCH[*]/256MiB/128MiB} --baselines none --backend tcp --json $OUT_DIR/bench-tcp-cuda.json"
    "bench-mooncake|50|$PY ${BENCH[*]/256MiB/128MiB} --baselines auto --interleave --backend mooncake --json $OUT_DIR/bench-mooncake-cuda.json"
    "bench-staged|40|$PY ${BENCH[*]/256MiB/128MiB} --receivers 2 --baselines none --staged --backend nccl --json $OUT_DIR/bench-staged-cuda.json"
)
TOTAL=0
for s in "${STEPS[@]}"; do TOTAL=$((TOTAL + $(cut -d'|' -f2 <<<"$s"))); done

echo "gpu-check: python $PY; $TORCH_LINE"
[[ -n "$SMI" ]] && echo "gpu-check: nvidia-smi: $SMI"

if [[ $DRY -eq 1 || ($FORCE -eq 0 && "$TORCH_LINE" != *"CUDA available: True"*) ]]; then
    if [[ $DRY -eq 1 ]]; then
        why="--dry-run"
    elif [[ -n "$SMI" ]]; then
        why="a GPU is present but this torch has no CUDA: install a CUDA build of torch into $PY's environment"
    else
        why="no CUDA here"
    fi
    echo "gpu-check: dry run ($why); on a CUDA machine it would run, each step bounded by timeout,"
    echo "${TOTAL}s at most in all, writing logs, JSON and summary.txt to $OUT_DIR/:"
    if [[ -n "$WHEELS" ]]; then
        echo "  first: install the $NWHEELS wheel(s) in $WHEELS into a temporary folder (no network)"
    fi
    printf '  %-14s %5s  %s\n' step limit command
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name secs cmd <<<"$s"
        printf '  %-14s %4ss  %s\n' "$name" "$secs" "$cmd"
    done
    exit 0
fi

# One line from a bench record: best median, verified, wtcore's ratio to each peer.
bench_detail() {
    "$PY" - "$1" 2>/dev/null <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
line = "%.2f GB/s, verified: %s" % (r["best_median_gbps"], r["ok"])
peers = ["%s %.2fx" % (n, r["ratios"][n]) for n in r.get("peers", []) if n in r["ratios"]]
print(line + ("; vs " + ", ".join(peers) if peers else ""))
EOF
}

if [[ -n "$WHEELS" ]]; then
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$WHEELS"/*.whl; then
        echo "gpu-check: could not install the wheels in $WHEELS with $PY (see above)" >&2
        exit 1
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    echo "gpu-check: installed $NWHEELS wheel(s) from $WHEELS"
fi

mkdir -p "$OUT_DIR"
ROWS=()
FAILED=0
for s in "${STEPS[@]}"; do
    IFS='|' read -r name secs cmd <<<"$s"
    log="$OUT_DIR/$name.log"
    echo "gpu-check: $name (limit ${secs}s): $cmd"
    start=$(date +%s)
    timeout -k 10 "$secs" bash -c "$cmd" >"$log" 2>&1
    rc=$?
    took=$(($(date +%s) - start))
    case $rc in
        0) status=PASS ;;
        124|137) status=TIMEOUT ;;
        *) status="FAIL($rc)" ;;
    esac
    [[ $rc -ne 0 ]] && FAILED=1
    case $name in
        bench-*) detail=$(bench_detail "$OUT_DIR/bench-${name#bench-}-cuda.json") \
                     || detail=$(tail -n 1 "$log") ;;
        env) detail=$TORCH_LINE ;;
        *) detail=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$log" | tail -n 1) ;;
    esac
    ROWS+=("$(printf '%-14s %-9s %5ss  %s' "$name" "$status" "$took" "${detail:0:110}")")
done

{
    echo
    echo "gpu-check summary ($TORCH_LINE; logs in $OUT_DIR/)"
    printf '%-14s %-9s %6s  %s\n' step status time detail
    printf '%s\n' "${ROWS[@]}"
} | tee "$OUT_DIR/summary.txt"
exit $FAILED
