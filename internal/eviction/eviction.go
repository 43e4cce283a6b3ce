// Package eviction watches whether Redis may evict quotaflow's state.
//
// Quota state lives in Redis: window counters, balances, reservations and
// the epoch key. A maxmemory-policy other than noeviction lets a full
// Redis drop some of it silently — allkeys-* policies any key, volatile-*
// ones any key with a TTL, which quota blobs all carry — so a user would
// get part of a quota back and a reservation could vanish before it
// settles. With noeviction a full Redis refuses writes instead, which
// admission handles like an outage (local decisions, counted).
//
// A Watcher reads maxmemory-policy and maxmemory with CONFIG GET at start
// and every minute after (a CONFIG SET at run time is noticed), logs each
// change, and reports a risky policy as a degradation of /readyz, which
// keeps the instance in service: a setting is no reason to stop answering.
// When CONFIG GET is refused (an ACL without +config|get, a managed Redis
// that renames CONFIG) the policy is unknown: that is logged and shown as a
// note, not as a failure.
//
// Admission and the accounter each run one (service.OpenRedis).
package eviction

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Interval is how often the policy is checked again after the first check.
const Interval = time.Minute

// checkTimeout bounds one check (two CONFIG GETs per node).
const checkTimeout = 5 * time.Second

// Client is what a Watcher needs of a go-redis client: CONFIG GET. A
// *redis.ClusterClient is checked on every master (ForEachMaster).
type Client interface {
	ConfigGet(ctx context.Context, parameter string) *redis.MapStringStringCmd
}

// masters is implemented by *redis.ClusterClient.
type masters interface {
	ForEachMaster(ctx context.Context, fn func(ctx context.Context, client *redis.Client) error) error
}

// State is what a check found.
type State struct {
	// Known is false when Redis refused to tell (Reason says why).
	Known bool
	// Policy is maxmemory-policy, e.g. "noeviction" or "allkeys-lru"; of a
	// cluster, the first master's that is not noeviction.
	Policy string
	// MaxMemory is maxmemory in bytes; 0 means no limit (none is evicted
	// until one is set, which a CONFIG SET can do at any time).
	MaxMemory int64
	// Reason explains an unknown state.
	Reason string
}

// Risky reports whether Redis is known to run an evicting policy.
func (s State) Risky() bool { return s.Known && s.Policy != "noeviction" }

// String describes the state for a log line or /readyz.
func (s State) String() string {
	switch {
	case !s.Known:
		return "maxmemory-policy unknown (" + s.Reason + "); quota state is only safe with noeviction"
	case s.Risky():
		return fmt.Sprintf("maxmemory-policy %s (maxmemory %d bytes) may evict quota state; set noeviction", s.Policy, s.MaxMemory)
	}
	return fmt.Sprintf("maxmemory-policy noeviction (maxmemory %d bytes)", s.MaxMemory)
}

// Watcher keeps the last State of one Redis. Create it with New; its
// methods are safe for concurrent use. Degraded and Note serve /readyz
// (obs.Readiness Watch and Note); Run keeps them current.
type Watcher struct {
	c   Client
	log *slog.Logger

	mu      sync.Mutex
	checked bool // a check got an answer from Redis
	state   State
}

// New returns a Watcher of c that logs to log.
func New(c Client, log *slog.Logger) *Watcher {
	return &Watcher{c: c, log: log.With("component", "redis_eviction")}
}

// Check reads the policy now, logs it if it changed and returns it. While
// Redis cannot be reached the last state stands: an outage is reported
// elsewhere and says nothing about the policy.
func (w *Watcher) Check(ctx context.Context) State {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	s, err := read(ctx, w.c)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.log.Debug("checking the eviction policy failed; keeping the last state", "err", err)
		return w.state
	}
	if w.checked && s == w.state {
		return s
	}
	first := !w.checked
	w.checked, w.state = true, s
	switch {
	case !s.Known:
		w.log.Warn("redis eviction policy unknown", "maxmemory_policy", "unknown", "reason", s.Reason)
	case s.Risky():
		w.log.Warn("redis may evict quota state: set maxmemory-policy noeviction",
			"maxmemory_policy", s.Policy, "maxmemory", s.MaxMemory)
	case !first:
		w.log.Info("redis eviction policy is noeviction", "maxmemory", s.MaxMemory)
	}
	return s
}

// Name is the entry of /readyz (degraded or notes) a Watcher reports.
const Name = "redis_eviction"

// Readiness is where a Watcher reports: *obs.Readiness.
type Readiness interface {
	Watch(dependency string, f func() (degraded bool, detail string))
	Note(name string, f func() string)
}

// Report makes r show a risky policy as degraded and an unknown one as a
// note, both under Name.
func (w *Watcher) Report(r Readiness) {
	r.Watch(Name, w.Degraded)
	r.Note(Name, w.Note)
}

// Degraded reports a risky policy, for obs.Readiness.Watch.
func (w *Watcher) Degraded() (bool, string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.state.Risky() {
		return true, w.state.String()
	}
	return false, ""
}

// Note is the note of an unknown policy, for obs.Readiness.Note.
func (w *Watcher) Note() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.checked && !w.state.Known {
		return w.state.String()
	}
	return ""
}

// read asks every master of c (c itself unless it is a cluster client).
// The error is a failure to reach Redis; a refusal is an unknown State.
func read(ctx context.Context, c Client) (State, error) {
	m, ok := c.(masters)
	if !ok {
		return readNode(ctx, c)
	}
	var mu sync.Mutex
	var worst State
	seen := false
	err := m.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
		s, err := readNode(ctx, n)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if !seen || rank(s) > rank(worst) {
			worst, seen = s, true
		}
		return nil
	})
	return worst, err
}

// rank orders the states of a cluster's nodes: one risky node puts the
// cluster at risk, and one unknown leaves its safety unknown.
func rank(s State) int {
	switch {
	case s.Risky():
		return 2
	case !s.Known:
		return 1
	}
	return 0
}

// readNode asks one node.
func readNode(ctx context.Context, c Client) (State, error) {
	policy, err := configGet(ctx, c, "maxmemory-policy")
	if err != nil {
		return refused(err)
	}
	max, err := configGet(ctx, c, "maxmemory")
	if err != nil {
		return refused(err)
	}
	n, perr := strconv.ParseInt(max, 10, 64)
	switch {
	case policy == "":
		return State{Reason: "CONFIG GET maxmemory-policy returned nothing"}, nil
	case perr != nil:
		return State{Reason: fmt.Sprintf("maxmemory %q is not a number", max)}, nil
	}
	return State{Known: true, Policy: policy, MaxMemory: n}, nil
}

func configGet(ctx context.Context, c Client, param string) (string, error) {
	m, err := c.ConfigGet(ctx, param).Result()
	if err != nil {
		return "", err
	}
	return m[param], nil
}

// refused turns Redis's refusal of CONFIG GET (NOPERM from an ACL, "ERR
// unknown command" where CONFIG is renamed) into an unknown State; any
// other error (network, LOADING, a failover) is a failure to reach Redis.
func refused(err error) (State, error) {
	var re redis.Error
	if errors.As(err, &re) && (strings.HasPrefix(re.Error(), "NOPERM") || strings.HasPrefix(re.Error(), "ERR ")) {
		return State{Reason: "CONFIG GET refused: " + re.Error()}, nil
	}
	return State{}, err
}
