package script

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// bumpOnFCall makes the first FCALL look as if another call's load had
// finished just before it: the load counter moves, the server still lacks
// the library (as after a failover to an empty replica).
type bumpOnFCall struct {
	redistest.RoundTrips
	r    *Runner
	once sync.Once
}

func (b *bumpOnFCall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "fcall" {
			b.once.Do(func() { b.r.loads.Add(1) })
		}
		return next(ctx, cmd)
	}
}

func TestACallMissingTheLibraryAfterAnotherLoadLoadsIt(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	r := NewRunner(c)
	c.AddHook(&bumpOnFCall{r: r})
	if err := reserveOnce(t, r); err != nil {
		t.Fatalf("reserve after a load that did not reach this server: %v", err)
	}
}

// reserveOnce makes one reserve through r and returns its error.
func reserveOnce(t *testing.T, r *Runner) (err error) {
	t.Helper()
	rules := []policy.Rule{{Limit: policy.Limit{Name: "5h", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1000, Window: policy.Duration(5 * time.Hour)}, Scope: policy.ScopeUser}}
	b := wire.NewParams(0, true, 0).NewReserveBatch()
	if err := b.Add("acme", "u", "r1", 1, wire.ModeReserve, 0, 0, rules); err != nil {
		t.Fatal(err)
	}
	call := b.Call()
	wire.DecodeReserves(r.Run(context.Background(), Reserve, &call), &call, func(_ int, _ wire.ReserveReply, e error) { err = e })
	return err
}

// The libraries of the engine's other versions go; this version's, and
// libraries whose names only look alike, stay.
func TestDropOtherVersions(t *testing.T) {
	ctx := context.Background()
	c := redistest.Start(t).Client()
	others := []string{"qf0123456789ab", "qfba9876543210"}
	kept := []string{"qf_hooktest", "qfABCDEF012345", "qf0123456789abc", "other"}
	for _, name := range append(slices.Clone(others), kept...) {
		redistest.LoadLibrary(t, c, name)
	}
	r := NewRunner(c)
	if err := reserveOnce(t, r); err != nil { // loads this version's library
		t.Fatal(err)
	}
	dropped, err := r.DropOtherVersions(ctx)
	if slices.Sort(dropped); err != nil || !slices.Equal(dropped, others) {
		t.Errorf("DropOtherVersions = %v, %v; want %v", dropped, err, others)
	}
	names := redistest.Libraries(t, c, "")
	want := append(slices.Clone(kept), engine.name)
	if slices.Sort(names); !slices.Equal(names, slices.Sorted(slices.Values(want))) {
		t.Errorf("libraries left = %v, want %v", names, want)
	}
	if dropped, err := r.DropOtherVersions(ctx); err != nil || len(dropped) != 0 {
		t.Errorf("DropOtherVersions again = %v, %v; want nothing to drop", dropped, err)
	}
	if err := reserveOnce(t, r); err != nil {
		t.Errorf("reserve after the drop: %v", err)
	}
}

// TestErrorChecksOfASuccessAllocateNothing checks that asking what a
// successful call's nil error means costs no allocation: each round trip
// asks it of every call (redis.HasErrorPrefix allocates for any error, nil
// included).
func TestErrorChecksOfASuccessAllocateNothing(t *testing.T) {
	for name, f := range map[string]func(error) bool{
		"functionsUnavailable": functionsUnavailable, "isNoFunction": isNoFunction, "isNoScript": isNoScript,
	} {
		if n := testing.AllocsPerRun(100, func() { f(nil) }); n != 0 {
			t.Errorf("%s(nil): %v allocations, want 0", name, n)
		}
		if f(redis.ErrClosed) {
			t.Errorf("%s(%v) = true, want false", name, redis.ErrClosed)
		}
	}
}
