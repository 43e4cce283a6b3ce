#!/usr/bin/env bash
# ensure.sh TOOL prints the path of a binary the tests run: a gateway (nginx or
# caddy), or promtool, installing its Debian package (nginx, caddy, prometheus)
# with apt-get, without recommends, when it is missing. deploy/deps.sh runs it
# for all three, and the tests run it again, so a plain `go test` works too. The
# package never starts its system service: a temporary policy-rc.d refuses
# service starts while it installs, and where systemd runs the service is
# disabled as well (it would start at the next boot and hold port 80, or for
# prometheus :9090, admission's ops port). The tests run their own gateways on
# free loopback ports; promtool only checks files.
#
# Exit status: 0 with the path on stdout; 3 when the gateway is missing and
# cannot be installed here (no apt-get, or neither root nor sudo), so callers
# outside CI may skip; 2 for an unknown gateway; anything else is a failure.
set -euo pipefail

gw=${1:-}
case $gw in
nginx | caddy) pkg=$gw ;;
promtool) pkg=prometheus ;;
*)
	echo "usage: ensure.sh nginx|caddy|promtool" >&2
	exit 2
	;;
esac

find_gateway() {
	command -v "$gw" 2>/dev/null && return 0
	[[ -x /usr/sbin/$gw ]] && echo "/usr/sbin/$gw" && return 0
	[[ -x /usr/bin/$gw ]] && echo "/usr/bin/$gw" && return 0
	return 1
}

# warn_prometheus warns, for promtool, when the packaged prometheus.service
# runs, or is enabled and so will run at the next boot: installed before
# ensure.sh ran (it disables only the service of a package it installs
# itself), it holds :9090, admission's default ops port, and admission then
# fails to start.
warn_prometheus() {
	[[ $gw == promtool ]] && command -v systemctl >/dev/null 2>&1 || return 0
	if systemctl is-active --quiet prometheus.service 2>/dev/null; then
		echo "ensure.sh: WARNING: prometheus.service is running and holds :9090, admission's default ops port (QF_OPS_ADDR):" \
			"stop it (sudo systemctl disable --now prometheus.service) or give admission another QF_OPS_ADDR" >&2
	elif systemctl is-enabled --quiet prometheus.service 2>/dev/null; then
		echo "ensure.sh: WARNING: prometheus.service is stopped but enabled, and at the next boot will hold :9090, admission's default ops port (QF_OPS_ADDR):" \
			"disable it (sudo systemctl disable prometheus.service) or give admission another QF_OPS_ADDR" >&2
	fi
}

if find_gateway; then
	warn_prometheus
	exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
	echo "ensure.sh: $gw is missing and apt-get is not available" >&2
	exit 3
fi
if [[ $EUID -eq 0 ]]; then
	sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
	sudo=(sudo -n)
else
	echo "ensure.sh: $gw is missing and installing it needs root or passwordless sudo" >&2
	exit 3
fi

# Concurrent runs (deps and a test, two test binaries) would fight over
# dpkg's lock; the second waits and then finds the binary. The lock comes
# before policy-rc.d: a run that saw the first run's file would not create
# its own, and would install after the first had removed it.
if command -v flock >/dev/null 2>&1; then
	exec 8>"${TMPDIR:-/tmp}/quotaflow-gateway-install.$EUID.lock"
	flock -w 600 8
	if find_gateway; then
		warn_prometheus
		exit 0
	fi
fi

policy=/usr/sbin/policy-rc.d
created_policy=false
if [[ ! -e $policy ]]; then
	printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
	"${sudo[@]}" chmod 755 "$policy"
	created_policy=true
fi
cleanup() {
	if $created_policy; then
		"${sudo[@]}" rm -f "$policy"
	fi
}
trap cleanup EXIT

echo "ensure.sh: installing $pkg with apt-get" >&2
"${sudo[@]}" apt-get update -qq >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg" >&2 8>&-
if [[ -d /run/systemd/system ]]; then
	echo "ensure.sh: disabling the packaged $pkg.service (the tests run their own)" >&2
	"${sudo[@]}" systemctl disable --now "$pkg.service" >&2 8>&- || true
fi
find_gateway
