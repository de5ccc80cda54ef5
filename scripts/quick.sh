#!/usr/bin/env bash
# `make quick`, the loop to run while you work (under 3 minutes on 2 cores): ruff and mypy as
# `make lint typecheck` run them, then every test that starts no child process, no server, no
# torch.distributed group, no Ray and no vLLM: the tests not marked `processes` (each test
# file marks its own, with `pytestmark` or per function), nor vllm, ray, multinode or gpu. `make test` runs everything.
# Prints pytest's summary, then `quick: N tests in S s`. Arguments go to pytest (`-x`, `-k ...`).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
STAMP=${STAMP:-.venv/.installed}  # made by `make quick` before this runs; not remade here
# The selection; the Makefile passes its QUICK_MARKERS, which `make test` complements.
MARKERS=${MARKERS:-"not processes and not vllm and not ray and not multinode and not gpu"}

# Each step runs even when one before it failed (-k: one loop shows every kind of failure); the
# exit status is non-zero if any failed.
start=$SECONDS
make --no-print-directory -k -o "$STAMP" lint typecheck
checks_rc=$?
checks=$((SECONDS - start))

log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$BIN/python" -m pytest -q -m "$MARKERS" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

# pytest's summary line: "5 failed, 599 passed, 451 deselected in 47.21s" (the last one: a
# library may still log at exit, as Mooncake's transfer engines do)
summary=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s" "$log" | tail -n 1)
count() { grep -Eo "[0-9]+ ($1)\b" <<<"$summary" | awk '{n += $1} END {print n + 0}'; }
ran=$(count "passed|failed|skipped|xfailed|xpassed")
left_out=$(count deselected)
[ "$checks_rc" = 0 ] && checks_said="passed" || checks_said="FAILED"
echo "quick: $ran tests in $((SECONDS - start)) s" \
    "(of $((ran + left_out)) collected; ruff and mypy ${checks_said} in ${checks} s;" \
    "pytest exit $rc)"
[ "$checks_rc" = 0 ] && exit "$rc"
exit 1
