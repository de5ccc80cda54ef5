#!/usr/bin/env bash
# System libraries the project's plugins load, installed by `make install` on a fresh machine.
#
# libibverbs.so.1: the Mooncake Transfer Engine (wtcore-mooncake) loads it at import, even for
# its TCP protocol. Installed with apt-get when missing and we are root (CI is); otherwise this
# says what to install and goes on: the mooncake engine then reports itself unavailable
# (`wtcore plugins`) and its tests fail naming the library.
set -euo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "system-deps: installing libibverbs1 (for wtcore-mooncake)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
else
    echo "system-deps: libibverbs.so.1 is missing; wtcore-mooncake needs it" \
        "(Debian/Ubuntu: apt-get install libibverbs1)" >&2
fi
