#!/usr/bin/env bash
# fuzz.sh runs every Fuzz target in the given packages (default ./...) for
# FUZZTIME each (default 10s), one after another, as `go test -fuzz` accepts
# one target at a time. It is what `go tool task fuzz` runs:
#
#   go tool task fuzz                        # all targets, 10s each
#   FUZZTIME=2m go tool task fuzz -- ./pkg/limits/policy
#
# A target that fails leaves its input in the package's testdata/fuzz/<Target>/;
# commit it, and the plain test run replays it from then on.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

fuzztime=${FUZZTIME:-10s}
(($# > 0)) || set -- ./...

# `go test -list` prints each package's matching names, then "ok <package> ...".
if ! listing=$(go test -list '^Fuzz' "$@" 2>&1); then
	printf '%s\n' "$listing" >&2
	echo "fuzz: listing the Fuzz targets failed" >&2
	exit 1
fi
targets=() pending=()
while read -r first pkg _; do
	case $first in
	Fuzz*) pending+=("$first") ;;
	ok)
		for name in "${pending[@]}"; do
			targets+=("$pkg $name")
		done
		pending=()
		;;
	*) ;;
	esac
done <<<"$listing"

if ((${#targets[@]} == 0)); then
	echo "fuzz: no Fuzz targets in $*"
	exit 0
fi

failed=()
for target in "${targets[@]}"; do
	read -r pkg name <<<"$target"
	echo "fuzz: $pkg $name for $fuzztime"
	# Go minimizes each new interesting input for up to 60s by default, and
	# the exec count stands still meanwhile: a short run of a slow target
	# (FuzzParse) would spend all its time minimizing instead of exploring.
	if ! go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" -fuzzminimizetime "$fuzztime" "$pkg"; then
		failed+=("$pkg $name")
	fi
done

echo "fuzz: ran ${#targets[@]} target(s) for $fuzztime each"
if ((${#failed[@]} > 0)); then
	echo "fuzz: failed (inputs saved under the package's testdata/fuzz/):" >&2
	printf '  %s\n' "${failed[@]}" >&2
	exit 1
fi
