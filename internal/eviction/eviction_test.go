package eviction

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/obs"
	"quotaflow/internal/redistest"
)

// readyz is the /readyz a Watcher reports into.
func readyz(t *testing.T, w *Watcher) obs.Status {
	t.Helper()
	r := obs.NewReadiness()
	w.Report(r)
	s, ok := r.Check()
	if !ok {
		t.Fatalf("/readyz not ready: %+v (a setting must never cost readiness)", s)
	}
	return s
}

// newWatcher returns a Watcher of c and its log. Check logs on the
// caller's goroutine, so the tests need no lock around the buffer.
func newWatcher(c Client) (*Watcher, *bytes.Buffer) {
	logs := &bytes.Buffer{}
	return New(c, slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))), logs
}

func TestEvictingPolicyIsDegraded(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
	w, logs := newWatcher(srv.Client())
	if s := w.Check(context.Background()); !s.Risky() || s.Policy != "allkeys-lru" || s.MaxMemory != 100<<20 {
		t.Fatalf("Check = %+v, want allkeys-lru with 100 MiB", s)
	}
	st := readyz(t, w)
	note := st.Degraded[Name]
	if st.Status != "degraded" || !strings.Contains(note, "allkeys-lru") || !strings.Contains(note, "104857600") || len(st.Notes) != 0 {
		t.Errorf("/readyz = %+v, want degraded naming allkeys-lru and maxmemory", st)
	}
	if l := logs.String(); !strings.Contains(l, `"level":"WARN"`) || !strings.Contains(l, `"maxmemory_policy":"allkeys-lru"`) ||
		!strings.Contains(l, `"maxmemory":104857600`) {
		t.Errorf("log = %s, want a warning naming the policy and maxmemory", l)
	}
}

func TestNoEvictionIsQuiet(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory-policy", "noeviction")
	w, logs := newWatcher(srv.Client())
	if s := w.Check(context.Background()); !s.Known || s.Risky() {
		t.Fatalf("Check = %+v, want noeviction", s)
	}
	if st := readyz(t, w); st.Status != "ready" || len(st.Degraded) != 0 || len(st.Notes) != 0 {
		t.Errorf("/readyz = %+v, want ready without a note", st)
	}
	if l := logs.String(); strings.Contains(l, "WARN") {
		t.Errorf("log = %s, want no warning", l)
	}
}

// A policy changed at run time is noticed by the next check, both ways;
// volatile policies evict too (quota blobs carry TTLs).
func TestRuntimeChangeIsNoticed(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory-policy", "noeviction")
	c := srv.Client()
	w, logs := newWatcher(c)
	ctx := context.Background()
	w.Check(ctx)
	if err := c.ConfigSet(ctx, "maxmemory-policy", "volatile-ttl").Err(); err != nil {
		t.Fatal(err)
	}
	if s := w.Check(ctx); s.Policy != "volatile-ttl" || !s.Risky() {
		t.Fatalf("Check after CONFIG SET = %+v, want volatile-ttl", s)
	}
	if st := readyz(t, w); !strings.Contains(st.Degraded[Name], "volatile-ttl") {
		t.Errorf("/readyz = %+v, want volatile-ttl degraded", st)
	}
	if err := c.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if s := w.Check(ctx); s.Risky() {
		t.Fatalf("Check after going back = %+v", s)
	}
	if st := readyz(t, w); st.Status != "ready" {
		t.Errorf("/readyz = %+v, want ready again", st)
	}
	if l := logs.String(); strings.Count(l, "redis may evict quota state") != 1 || !strings.Contains(l, "is noeviction") {
		t.Errorf("log = %s, want one warning and one all-clear", l)
	}
	// An unreachable Redis says nothing about the policy: the last state
	// stands.
	if err := c.ConfigSet(ctx, "maxmemory-policy", "allkeys-random").Err(); err != nil {
		t.Fatal(err)
	}
	w.Check(ctx)
	srv.Stop()
	if s := w.Check(ctx); s.Policy != "allkeys-random" {
		t.Errorf("Check with Redis down = %+v, want the last state", s)
	}
}

// CONFIG GET refused by an ACL, or CONFIG renamed away: the policy is
// unknown, a note, never a degradation or an error.
func TestRefusedConfigIsUnknown(t *testing.T) {
	acl := redistest.Start(t, "--maxmemory-policy", "allkeys-lru")
	ctx := context.Background()
	if err := acl.Client().Do(ctx, "ACL", "SETUSER", "qf", "on", ">qf-pass", "~*", "&*", "+@all", "-config").Err(); err != nil {
		t.Fatal(err)
	}
	limited := redis.NewClient(&redis.Options{Addr: acl.Addr, Username: "qf", Password: "qf-pass"})
	t.Cleanup(func() { limited.Close() })
	renamed := redistest.Start(t, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "")

	for name, c := range map[string]Client{"acl": limited, "renamed": renamed.Client()} {
		t.Run(name, func(t *testing.T) {
			w, logs := newWatcher(c)
			if s := w.Check(ctx); s.Known || s.Reason == "" {
				t.Fatalf("Check = %+v, want unknown with a reason", s)
			}
			st := readyz(t, w)
			if st.Status != "ready" || len(st.Degraded) != 0 || !strings.Contains(st.Notes[Name], "unknown") {
				t.Errorf("/readyz = %+v, want ready with an \"unknown\" note", st)
			}
			if l := logs.String(); !strings.Contains(l, `"maxmemory_policy":"unknown"`) || strings.Contains(l, "ERROR") {
				t.Errorf("log = %s, want the policy logged as unknown", l)
			}
		})
	}
}

func TestClusterReportsTheWorstMaster(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	w, _ := newWatcher(cc)
	if s := w.Check(ctx); !s.Known || s.Risky() {
		t.Fatalf("Check = %+v, want noeviction on every master", s)
	}
	var mu sync.Mutex // ForEachMaster calls concurrently
	n := 0
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		n++
		if n == 2 {
			return c.ConfigSet(ctx, "maxmemory-policy", "volatile-lru").Err()
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if s := w.Check(ctx); s.Policy != "volatile-lru" {
		t.Errorf("Check with one evicting master = %+v, want volatile-lru", s)
	}
}
