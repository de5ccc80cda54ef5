#!/usr/bin/env bash
# The wheels `scripts/gpu-check.sh --wheels DIR` installs on a GPU machine that has a CUDA
# torch but neither wtcore nor a network: every distribution of this checkout (pure Python,
# built here without build isolation), and the binary packages the engines need beyond what
# such a machine usually has, downloaded for that machine's Python (Mooncake, pybase64; the
# versions installed here, so the GPU runs what the tests ran).
#
# Usage: scripts/gpu-wheels.sh [--python-version X.Y] DIR
#   --python-version X.Y  the GPU machine's Python (default: this one's)
#
# Why not install from source there: building needs setuptools>=77 and, with build isolation,
# the network. Exit status: 0 when every wheel is in DIR, 1 otherwise.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=${PYTHON:-python3}; fi
VERSION=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
DIR=
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) VERSION=$2; shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu-wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
        *) DIR=$1 ;;
    esac
    shift
done
[[ -n "$DIR" ]] || { echo "gpu-wheels: name the folder for the wheels (see --help)" >&2; exit 2; }
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

for dist in "$ROOT" "$ROOT"/plugins/*/; do
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$dist"
done
rm -rf "$ROOT"/build "$ROOT"/plugins/*/build  # what setuptools leaves behind

# The binary needs, at the versions installed here: `name==version` of each that is.
PINS=$("$PY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

for name in ("pybase64", "mooncake-transfer-engine-non-cuda"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
)
TAG=${VERSION/./}
for pin in $PINS; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" \
        --implementation cp --abi "cp$TAG" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "$pin"
done
echo "gpu-wheels: $(compgen -G "$DIR/*.whl" | wc -l) wheel(s) in $DIR for Python $VERSION"
