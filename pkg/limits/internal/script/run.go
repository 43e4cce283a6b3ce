package script

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/wire"
)

// Runner sends calls of the engine's entries to Redis through one client.
// It is safe for concurrent use; create it with NewRunner.
type Runner struct {
	c Client
	// scriptsOnly is set once the server turned out not to serve functions.
	scriptsOnly atomic.Bool
	// loads counts the library's loads; loading serializes them, so calls
	// that miss the library together load it once.
	loads   atomic.Uint64
	loading sync.Mutex
}

// NewRunner returns a Runner over c, which may be a single node, a
// Sentinel failover client or a Redis Cluster client.
func NewRunner(c Client) *Runner { return &Runner{c: c} }

// Run calls entry e once, as RunAll does.
func (r *Runner) Run(ctx context.Context, e *Entry, c *wire.Call) *redis.Cmd {
	return r.RunAll(ctx, e, []wire.Call{*c})[0]
}

// SlotBound reports whether the keys of one call must share a hash slot:
// on a Cluster (the server refuses others), on a Ring (which picks a
// call's shard by its first key) and on any client it does not know. A
// *redis.Client (one node, or Sentinel's failover client) takes the keys
// of many tenants in one call.
func (r *Runner) SlotBound() bool {
	_, node := r.c.(*redis.Client)
	return !node
}

// pipeliner is what RunAll needs to pipeline.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// RunAll runs entry e for every valid call and returns its command (nil
// for the invalid ones): as FCALL while the server serves functions, and
// again, after loading the library, for the ones a node answered that it
// lacks it; else as EVALSHA, and again as EVAL for the ones a node answered
// NOSCRIPT. Several calls go out in one pipeline per attempt when the
// client pipelines, a lone call as a plain command. A node misses the
// library or the script for all the calls it gets, so retried calls keep
// their order among themselves.
//
// A call that a Cluster refused because its slot is being moved (TRYAGAIN:
// its keys are split between the two masters, or it adds keys beside
// existing ones; a MOVED or ASK go-redis gave up following) did not run,
// so it is sent again after a pause, up to movingTries times, while ctx
// lasts twice the pause (else the refusal is returned at once): a slot's
// move lasts as long as its keys take to MIGRATE. The calls of other slots
// in the pipeline wait for those retries. A Cluster client
// made by redisconn.NewCluster retries nothing itself; one that retries
// (go-redis's default MaxRedirects) may overwrite the replies of a
// pipeline's other calls with ctx's error.
func (r *Runner) RunAll(ctx context.Context, e *Entry, calls []wire.Call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	valid := make([]int, 0, len(calls))
	for i := range calls {
		if calls[i].Err == nil {
			valid = append(valid, i)
		}
	}
	r.runOnce(ctx, e, calls, cmds, valid)
	for try := range movingTries {
		moving := failed(cmds, valid, SlotMoving)
		if len(moving) == 0 || !outlasts(ctx, movingPause(try)) || sleep(ctx, movingPause(try)) != nil {
			break
		}
		r.runOnce(ctx, e, calls, cmds, moving)
	}
	return cmds
}

// movingTries and movingPause bound the retries of calls refused while
// their slot moves: pauses of 2 ms doubling to 128 ms, about 1.3 s in all
// (TestReshardUnderLoad's slot of ~200 keys, moved 4 keys at a time, took
// 0.3-0.5 s on a loaded host).
const movingTries = 15

func movingPause(try int) time.Duration { return min(2*time.Millisecond<<try, 128*time.Millisecond) }

// outlasts reports whether ctx lasts for a pause of d and as long again
// for the call after it: one that ends in that call, after the refusal,
// would leave a timeout (which may have run) where a refusal (which did
// not) was known.
func outlasts(ctx context.Context, d time.Duration) bool {
	end, ok := ctx.Deadline()
	return !ok || time.Until(end) > 2*d
}

// SlotMoving reports whether err is a Cluster's refusal of a call whose
// slot is being moved; the call did not run.
func SlotMoving(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "TRYAGAIN") || redis.HasErrorPrefix(err, "ASK") || redis.HasErrorPrefix(err, "MOVED"))
}

// sleep waits d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// failed returns the calls of which whose command failed as match says.
func failed(cmds []*redis.Cmd, which []int, match func(error) bool) []int {
	var out []int
	for _, i := range which {
		if match(cmds[i].Err()) {
			out = append(out, i)
		}
	}
	return out
}

// runOnce sends the calls valid names, setting their commands, as RunAll
// describes: FCALL (loading the library where it is missing) or
// EVALSHA/EVAL.
func (r *Runner) runOnce(ctx context.Context, e *Entry, calls []wire.Call, cmds []*redis.Cmd, valid []int) {
	p, pipelines := r.c.(pipeliner)
	const (
		fcall = iota
		evalsha
		eval
	)
	send := func(how int, which []int) {
		var to Client = r.c
		var pipe redis.Pipeliner
		if pipelines && len(which) > 1 {
			pipe = p.Pipeline()
			to = pipe
		}
		for _, i := range which {
			c := &calls[i]
			switch how {
			case fcall:
				cmds[i] = fcallCmd(ctx, to, e.fn, c)
			case evalsha:
				cmds[i] = e.script().EvalSha(ctx, to, c.Keys, c.Args...)
			default:
				cmds[i] = e.script().Eval(ctx, to, c.Keys, c.Args...)
			}
		}
		if pipe != nil {
			_, _ = pipe.Exec(ctx) // each command holds its own error
		}
	}
	if len(valid) == 0 {
		return
	}
	if r.usesFunctions(e) {
		seen := r.loads.Load()
		send(fcall, valid)
		missing := failed(cmds, valid, isNoFunction)
		for try := 0; len(missing) > 0 && try < loadTries; try++ {
			if err := r.loadEngine(ctx, seen); err != nil {
				for _, i := range missing {
					cmds[i].SetErr(err)
				}
				break
			}
			seen = r.loads.Load()
			send(fcall, missing)
			missing = failed(cmds, missing, isNoFunction)
		}
		valid = failed(cmds, valid, functionsUnavailable)
		if len(valid) == 0 {
			return
		}
		r.scriptsOnly.Store(true)
	}
	send(evalsha, valid)
	if missing := failed(cmds, valid, isNoScript); len(missing) > 0 {
		send(eval, missing)
	}
}

// fcallCmd is go-redis's FCall(ctx, fn, c.Keys, c.Args...) with each key passed
// as a *string, which go-redis writes (and routes a Cluster call by) as the
// string: boxing each key string in an interface value was an allocation
// per key, about 2 per reserve, 50 a call of 25 (the call keeps c.Keys
// alive until it is written).
func fcallCmd(ctx context.Context, to Client, fn string, c *wire.Call) *redis.Cmd {
	args := make([]any, 3, 3+len(c.Keys)+len(c.Args))
	args[0], args[1], args[2] = "fcall", fn, len(c.Keys)
	for i := range c.Keys {
		args = append(args, &c.Keys[i])
	}
	cmd := redis.NewCmd(ctx, append(args, c.Args...)...)
	if len(c.Keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	_ = to.Process(ctx, cmd) // the command holds its error
	return cmd
}

// isNoScript reports whether err says the node has not cached the script,
// in either form go-redis hands it over.
func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}

// usesFunctions reports whether calls of e go out as FCALL.
func (r *Runner) usesFunctions(e *Entry) bool {
	return e.fn != "" && !r.scriptsOnly.Load()
}

// loadTries is how often a call that misses the library loads it and tries
// again. Twice: the first load may be skipped because another call's load
// finished meanwhile, and that load may have reached another node (a
// failover in between); the second one then loads.
const loadTries = 2

// loadEngine loads the library on every node that may serve the engine: all
// masters of a Cluster, all shards of a Ring, else the one server.
// Replicas receive it from their masters. seen is the count of loads the
// caller read before its call missed the library: when a load has finished
// since, as when many calls miss it at once after a restart, the library is
// there and only the first of them loads it.
func (r *Runner) loadEngine(ctx context.Context, seen uint64) error {
	r.loading.Lock()
	defer r.loading.Unlock()
	if r.loads.Load() != seen {
		return nil
	}
	err := EachNode(ctx, r.c, func(ctx context.Context, n redis.Cmdable) error { return loadLibrary(ctx, n) })
	if err != nil {
		return fmt.Errorf("load the limits engine into redis: %w", err)
	}
	r.loads.Add(1)
	return nil
}

// DropOtherVersions deletes, on every node, the libraries of the engine's
// other versions: each release's stays in Redis until deleted. An
// instance of another version still running loads its own again when a
// call misses it (RunAll), so a rolling deploy leaves at most the library
// of the version before behind, which the next deploy drops. It returns
// the libraries it deleted; a server without functions (or an ACL
// without FUNCTION) has none to delete.
func (r *Runner) DropOtherVersions(ctx context.Context) ([]string, error) {
	var mu sync.Mutex
	var dropped []string
	err := EachNode(ctx, r.c, func(ctx context.Context, n redis.Cmdable) error {
		libs, err := n.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: libraryPrefix + "*"}).Result()
		if functionsUnavailable(err) {
			return nil
		}
		if err != nil {
			return err
		}
		for _, l := range libs {
			if l.Name == engine.name || !isLibraryName(l.Name) {
				continue
			}
			err := n.FunctionDelete(ctx, l.Name).Err()
			if redis.HasErrorPrefix(err, "Library not found") { // another instance's delete came first
				continue
			}
			if functionsUnavailable(err) { // an ACL that lets it list, not delete
				return nil
			}
			if err != nil {
				return err
			}
			mu.Lock()
			dropped = append(dropped, l.Name)
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		return dropped, fmt.Errorf("drop the limits engine's other versions: %w", err)
	}
	return dropped, nil
}

// EachNode runs f on every node that holds state of c: each master of a
// Cluster, each shard of a Ring, else c itself (replicas follow their
// masters).
func EachNode(ctx context.Context, c any, f func(context.Context, redis.Cmdable) error) error {
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
