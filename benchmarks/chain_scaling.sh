#!/usr/bin/env bash
# Round time with every node's link capped, for 1, 2, 4 and 6 receivers: nccl's collective
# broadcast (gloo) against tcp's relay chain (docs/benchmarks.md, "Scaling under a bandwidth
# cap"). Root only (network namespaces). Usage:
#   benchmarks/chain_scaling.sh [OUT_DIR] [RATE] [SIZE]
set -euo pipefail
out=${1:-/tmp/wtcore-chain-scaling}
rate=${2:-1gbit}
size=${3:-256MiB}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
for n in 1 2 4 6; do
  for mode in collective chain; do
    engine=(--backend nccl --engine-option broadcast=collective)
    [ "$mode" = chain ] && engine=(--backend tcp --engine-option topology=chain)
    "$py" -m wtcore.cli bench "${engine[@]}" --client http --nodes "$n" --receivers "$n" \
      --link-rate "$rate" --size "$size" --dtype float32 --tensors 64 --buffer-size 32MiB \
      --rounds 5 --json "$out/$mode-$n.json" \
      > "$out/$mode-$n.txt" 2> "$out/$mode-$n.err" || echo "FAILED: $mode $n (see $out/$mode-$n.err)"
    "$py" - "$out/$mode-$n.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
run = r["runs"][0]
print(f"{r['settings']['backend']:>5} {r['settings']['engine_options']} receivers={r['link']['receivers']} "
      f"median_s={run['median_seconds']:.3f} GB/s={run['median_gbps']:.3f} "
      f"cap_fraction={r['link']['achieved_fraction']:.2f} verified={r['ok']}")
PY
  done
done
