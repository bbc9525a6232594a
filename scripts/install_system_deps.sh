#!/usr/bin/env bash
# The system libraries that Python packages cannot bring: Mooncake's Transfer Engine (PD disaggregation's default
# KV transfer backend) links against libibverbs, librdmacm, liburing, libnuma and libcurl.
#
# Quick when they are present (one ldconfig look-up, no apt). When some are missing: as root on Debian/Ubuntu it
# installs them with apt-get; anywhere else it prints what to install and succeeds anyway, because everything but
# Mooncake works without them (PD can use `--disaggregation-transfer-backend zmq`).
set -uo pipefail

# shared library -> the Debian package holding it
LIBS=(libibverbs.so.1 librdmacm.so.1 liburing.so.2 libnuma.so.1 libcurl.so.4)
PKGS=(libibverbs1 librdmacm1 liburing2 libnuma1 libcurl4)

missing_pkgs() {
    local cache i out=()
    cache=$(PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null)
    for i in "${!LIBS[@]}"; do
        grep -qF "${LIBS[$i]} " <<<"$cache" || out+=("${PKGS[$i]}")
    done
    echo "${out[@]}"
}

missing=$(missing_pkgs)
[ -z "$missing" ] && exit 0

advice() {
    echo "install_system_deps: Mooncake's Transfer Engine needs these system packages, which are missing: $missing" >&2
    echo "  on Debian/Ubuntu: sudo apt-get install -y $missing" >&2
    echo "  without them PD disaggregation runs with --disaggregation-transfer-backend zmq (everything else works)" >&2
}

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    advice
    exit 0
fi

echo "install_system_deps: installing $missing (for Mooncake's Transfer Engine)"
export DEBIAN_FRONTEND=noninteractive
if ! log=$({ apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } 2>&1); then
    echo "$log" | tail -5 >&2
    echo "install_system_deps: apt-get failed" >&2
    advice
    exit 0
fi
missing=$(missing_pkgs)
[ -z "$missing" ] || advice
exit 0
