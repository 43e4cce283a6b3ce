package limits

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Client is what a Limiter needs from go-redis: scripts, and Redis
// functions where the server has them. *redis.Client (single node or
// Sentinel failover), *redis.ClusterClient and *redis.Ring satisfy it.
type Client interface {
	redis.Scripter
	FCall(ctx context.Context, function string, keys []string, args ...any) *redis.Cmd
	FunctionLoad(ctx context.Context, code string) *redis.StringCmd
}

// entry is one entry point of the Lua engine (lib.lua followed by the
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
type entry struct {
	fn     string        // the function's name in the library; "" runs only as a script
	script *redis.Script // the same code as a script
}

// engine is the function library: every entry that shares lib.lua.
var engine = newLibrary([][2]string{
	{"reserve", luaReserve},
	{"settle", luaSettle},
	{"charge", luaCharge},
	{"lease", luaLease},
	{"topup", luaTopUp},
	{"void", luaVoid},
	{"restore", luaRestore},
})

// The entries of the engine.
var (
	reserveEntry = engine.entries["reserve"]
	settleEntry  = engine.entries["settle"]
	chargeEntry  = engine.entries["charge"]
	leaseEntry   = engine.entries["lease"]
	topUpEntry   = engine.entries["topup"]
	voidEntry    = engine.entries["void"]
	restoreEntry = engine.entries["restore"]
)

// library is the engine's code as one Redis function library.
type library struct {
	code    string
	entries map[string]*entry
}

// newLibrary builds the library of the given entries (name, entry code).
// Its top level may not touch Lua's standard libraries (Redis exposes only
// redis.register_function while loading), so lib.lua and the entries are
// wrapped in a function that the first call runs; KEYS and ARGV, the
// globals a script sees, are upvalues that each call sets.
func newLibrary(codes [][2]string) *library {
	var body strings.Builder
	body.WriteString("local KEYS, ARGV\nlocal run\nlocal function init()\n")
	body.WriteString(luaLib)
	body.WriteString("\nreturn {\n")
	for _, c := range codes {
		body.WriteString(c[0] + " = function()\n" + c[1] + "\nend,\n")
	}
	body.WriteString("}\nend\n")
	sum := sha1.Sum([]byte(body.String()))
	prefix := "qf" + hex.EncodeToString(sum[:6])
	lib := &library{entries: make(map[string]*entry, len(codes))}
	for _, c := range codes {
		fn := prefix + "_" + c[0]
		lib.entries[c[0]] = &entry{fn: fn, script: redis.NewScript(luaLib + c[1])}
		body.WriteString("redis.register_function('" + fn + "', function(k, a)\n" +
			"  KEYS, ARGV = k, a\n  run = run or init()\n  return run." + c[0] + "()\nend)\n")
	}
	lib.code = "#!lua name=" + prefix + "\n" + body.String()
	return lib
}

// functionsUnavailable reports whether err says the server cannot serve the
// engine as functions: it has no FCALL or FUNCTION (before Redis 7), or the
// ACL forbids them.
func functionsUnavailable(err error) bool {
	return redis.HasErrorPrefix(err, "unknown command") || redis.HasErrorPrefix(err, "NOPERM")
}

// isNoFunction reports whether err says the node lacks the library: it
// restarted without persistence, failed over to an empty replica, or had
// its functions flushed.
func isNoFunction(err error) bool {
	return redis.HasErrorPrefix(err, "Function not found")
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

// loadEngine loads the library on every node that may serve the engine: all
// masters of a Cluster, all shards of a Ring, else the one server.
// Replicas receive it from their masters. seen is the count of loads the
// caller read before its call missed the library: when a load has finished
// since, as when many calls miss it at once after a restart, the library is
// there and only the first of them loads it.
func (l *Limiter) loadEngine(ctx context.Context, seen uint64) error {
	l.loading.Lock()
	defer l.loading.Unlock()
	if l.loads.Load() != seen {
		return nil
	}
	err := eachNode(ctx, l.rdb, func(ctx context.Context, n redis.Cmdable) error { return loadLibrary(ctx, n) })
	if err != nil {
		return fmt.Errorf("load the limits engine into redis: %w", err)
	}
	l.loads.Add(1)
	return nil
}

// eachNode runs f on every node that holds state of c: each master of a
// Cluster, each shard of a Ring, else c itself (replicas follow their
// masters).
func eachNode(ctx context.Context, c any, f func(context.Context, redis.Cmdable) error) error {
	each := func(ctx context.Context, n *redis.Client) error { return f(ctx, n) }
	switch c := c.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, each)
	case *redis.Ring:
		return c.ForEachShard(ctx, each)
	case redis.Cmdable:
		return f(ctx, c)
	}
	return fmt.Errorf("%T is no Redis client", c)
}

// usesFunctions reports whether calls of e go out as FCALL.
func (l *Limiter) usesFunctions(e *entry) bool {
	return e.fn != "" && !l.scriptsOnly.Load()
}

// loadTries is how often a call that misses the library loads it and tries
// again. Twice: the first load may be skipped because another call's load
// finished meanwhile, and that load may have reached another node (a
// failover in between); the second one then loads.
const loadTries = 2

// run calls entry e once, as runAll does.
func (l *Limiter) run(ctx context.Context, e *entry, keys []string, args ...any) *redis.Cmd {
	return l.runAll(ctx, e, []call{{keys: keys, args: args}})[0]
}
