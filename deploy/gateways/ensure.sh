#!/usr/bin/env bash
# ensure.sh GATEWAY prints the path of the gateway's binary (nginx or caddy),
# installing Debian's package of that name with apt-get when it is missing.
# deploy/deps.sh runs it for both, and the gateway tests run it again, so a
# plain `go test` works too. The package never starts a system gateway: a
# temporary policy-rc.d refuses service starts while it installs, and where
# systemd runs its service is disabled as well (it would start at the next
# boot and hold port 80). The tests run their own gateways on free loopback
# ports.
#
# Exit status: 0 with the path on stdout; 3 when the gateway is missing and
# cannot be installed here (no apt-get, or neither root nor sudo), so callers
# outside CI may skip; 2 for an unknown gateway; anything else is a failure.
set -euo pipefail

gw=${1:-}
case $gw in
nginx | caddy) ;;
*)
	echo "usage: ensure.sh nginx|caddy" >&2
	exit 2
	;;
esac

find_gateway() {
	command -v "$gw" 2>/dev/null && return 0
	[[ -x /usr/sbin/$gw ]] && echo "/usr/sbin/$gw" && return 0
	[[ -x /usr/bin/$gw ]] && echo "/usr/bin/$gw" && return 0
	return 1
}

if find_gateway; then
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

echo "ensure.sh: installing $gw with apt-get" >&2
"${sudo[@]}" apt-get update -qq >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$gw" >&2 8>&-
if [[ -d /run/systemd/system ]]; then
	echo "ensure.sh: disabling the packaged $gw.service (the tests run their own $gw)" >&2
	"${sudo[@]}" systemctl disable --now "$gw.service" >&2 8>&- || true
fi
find_gateway
