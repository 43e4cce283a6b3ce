// Package script runs the limits engine's Lua in Redis: the sources under
// lua/, assembled into one function library and, for servers without
// functions, into plain scripts; and a Runner that sends calls (built by
// package wire) to them, pipelined.
package script

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

//go:embed lua/lib.lua
var luaLib string

//go:embed lua/reserve.lua
var luaReserve string

//go:embed lua/settle.lua
var luaSettle string

//go:embed lua/charge.lua
var luaCharge string

//go:embed lua/lease.lua
var luaLease string

//go:embed lua/topup.lua
var luaTopUp string

//go:embed lua/admitted.lua
var luaAdmitted string

//go:embed lua/void.lua
var luaVoid string

//go:embed lua/count.lua
var luaCount string

//go:embed lua/restore.lua
var luaRestore string

//go:embed lua/windows.lua
var luaWindows string

// Client is what a Runner needs from go-redis: scripts, and Redis
// functions where the server has them. *redis.Client (single node or
// Sentinel failover), *redis.ClusterClient and *redis.Ring satisfy it.
// limits.Client spells the same methods out, so that its users see them.
type Client interface {
	redis.Scripter
	FunctionLoad(ctx context.Context, code string) *redis.StringCmd
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Entry is one entry point of the Lua engine (lib.lua followed by the
// entry's code).
//
// On Redis 7 and later the entries run as functions of one library: Redis
// runs a library's top level once, so lib.lua's closures and state table are
// built on the first call and kept, where a script rebuilds them on every
// call — about 30k of a reserve's 390k instructions, on the core that caps
// the whole system (bench/results.md). A server without functions (Redis 6,
// or an ACL that forbids them) gets the same code as EVALSHA scripts.
//
// The library's name and its functions' names carry a hash of its code, so
// instances of different releases, each calling the code it was built with,
// share a Redis during a rolling upgrade.
type Entry struct {
	fn string // the function's name in the library; "" runs only as a script
	// script is the same code as a script, built on first use: only a
	// server without functions runs it, and each entry's copy of lib.lua
	// would keep ~40 KB on the heap, doubled by the collector's headroom.
	script func() *redis.Script
}

// newEntry returns the entry of function fn (none: "") and script code src.
func newEntry(fn string, src func() string) *Entry {
	return &Entry{fn: fn, script: sync.OnceValue(func() *redis.Script { return redis.NewScript(src()) })}
}

// engineCode is every entry that shares lib.lua: its name (that of its
// file in lua/) and its code.
var engineCode = [][2]string{
	{"reserve", luaReserve},
	{"settle", luaSettle},
	{"charge", luaCharge},
	{"lease", luaLease},
	{"topup", luaTopUp},
	{"void", luaVoid},
	{"restore", luaRestore},
	{"count", luaCount},
}

// engine is the function library of engineCode.
var engine = newLibrary(luaLib, engineCode)

// The entries of the engine (wire builds their calls).
var (
	Reserve = engine.entries["reserve"]
	Settle  = engine.entries["settle"]
	Charge  = engine.entries["charge"]
	Lease   = engine.entries["lease"]
	TopUp   = engine.entries["topup"]
	Void    = engine.entries["void"]
	Restore = engine.entries["restore"]
	Count   = engine.entries["count"]
)

// Entries that need none of lib.lua run as scripts only: the library
// spares the rebuild of lib.lua's state on every call, which they do not
// make.
var (
	Windows  = newEntry("", func() string { return luaWindows })
	Admitted = newEntry("", func() string { return admittedCode })
)

// admittedCode is admitted.lua with its names written in, at
// initialisation as the library's are, so that a name no table holds fails
// there and not on the first call.
var admittedCode = mustExpand("admitted", luaAdmitted)

// library is the engine's code as one Redis function library.
type library struct {
	name    string // libraryPrefix and 12 hex digits of the code's hash
	code    string
	entries map[string]*Entry
}

// libraryPrefix starts the name of every version's library.
const libraryPrefix = "qf"

// isLibraryName reports whether name is that of a version of the engine:
// libraryPrefix and 12 lowercase hex digits.
func isLibraryName(name string) bool {
	rest, ok := strings.CutPrefix(name, libraryPrefix)
	if !ok || len(rest) != 12 {
		return false
	}
	for _, c := range []byte(rest) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// newLibrary builds the library of the given entries (name, entry code)
// on lib, with their names written in (names.go). Its top level may not
// touch Lua's standard libraries (Redis exposes only
// redis.register_function while loading), so lib and the entries are
// wrapped in a function that the first call runs; KEYS and ARGV, the
// globals a script sees, are upvalues that each call sets.
func newLibrary(lib string, entries [][2]string) *library {
	lib = mustExpand("lib", lib)
	codes := make([][2]string, len(entries))
	for i, e := range entries {
		codes[i] = [2]string{e[0], mustExpand(e[0], e[1])}
	}
	var body strings.Builder
	body.WriteString("local KEYS, ARGV\nlocal run\nlocal function init()\n")
	body.WriteString(lib)
	body.WriteString("\nreturn {\n")
	for _, c := range codes {
		body.WriteString(c[0] + " = function()\n" + c[1] + "\nend,\n")
	}
	body.WriteString("}\nend\n")
	sum := sha1.Sum([]byte(body.String()))
	prefix := libraryPrefix + hex.EncodeToString(sum[:6])
	l := &library{name: prefix, entries: make(map[string]*Entry, len(codes))}
	for _, c := range codes {
		fn := prefix + "_" + c[0]
		l.entries[c[0]] = newEntry(fn, func() string { return lib + c[1] })
		body.WriteString("redis.register_function('" + fn + "', function(k, a)\n" +
			"  KEYS, ARGV = k, a\n  run = run or init()\n  return run." + c[0] + "()\nend)\n")
	}
	l.code = "#!lua name=" + prefix + "\n" + body.String()
	return l
}

// functionsUnavailable reports whether err says the server cannot serve the
// engine as functions: it has no FCALL or FUNCTION (before Redis 7), or the
// ACL forbids them. A nil err is checked first: HasErrorPrefix allocates
// for any err, and every call's outcome is asked (three allocations a round
// trip).
func functionsUnavailable(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "unknown command") || redis.HasErrorPrefix(err, "NOPERM"))
}

// isNoFunction reports whether err says the node lacks the library: it
// restarted without persistence, failed over to an empty replica, or had
// its functions flushed.
func isNoFunction(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "Function not found")
}

// functionLoader is a client that can load a library.
type functionLoader interface {
	FunctionLoad(ctx context.Context, code string) *redis.StringCmd
}

// loadLibrary loads the engine on c; another instance having loaded it
// first is no failure.
func loadLibrary(ctx context.Context, c functionLoader) error {
	err := c.FunctionLoad(ctx, engine.code).Err()
	if err != nil && strings.Contains(err.Error(), "already exists") {
		return nil
	}
	return err
}
