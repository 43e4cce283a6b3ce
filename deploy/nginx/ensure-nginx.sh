#!/usr/bin/env bash
# ensure-nginx.sh prints the path of an nginx binary, installing Debian's
# nginx package with apt-get when there is none. It keeps the package from
# starting a system nginx (a temporary policy-rc.d refuses service starts):
# the tests run their own nginx on free loopback ports.
#
# Exit status: 0 with the path on stdout; 3 when nginx is missing and cannot
# be installed here (no apt-get, or neither root nor sudo), so callers may
# skip; anything else is a failure.
set -euo pipefail

find_nginx() {
	command -v nginx 2>/dev/null && return 0
	[[ -x /usr/sbin/nginx ]] && echo /usr/sbin/nginx && return 0
	return 1
}

if find_nginx; then
	exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
	echo "ensure-nginx: nginx is missing and apt-get is not available" >&2
	exit 3
fi
if [[ $EUID -eq 0 ]]; then
	sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
	sudo=(sudo -n)
else
	echo "ensure-nginx: nginx is missing and installing it needs root or passwordless sudo" >&2
	exit 3
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

echo "ensure-nginx: installing nginx with apt-get" >&2
"${sudo[@]}" apt-get update -qq >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx >&2
find_nginx
