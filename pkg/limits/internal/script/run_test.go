package script

import (
	"context"
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
	rules := []policy.Rule{{Limit: policy.Limit{Name: "5h", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1000, Window: policy.Duration(5 * time.Hour)}, Scope: policy.ScopeUser}}
	b := wire.NewParams(0, true, 0).NewReserveBatch()
	if err := b.Add("acme", "u", "r1", 1, wire.ModeReserve, 0, 0, rules); err != nil {
		t.Fatal(err)
	}
	call := b.Call()
	wire.DecodeReserves(r.Run(context.Background(), Reserve, &call), &call, func(_ int, _ wire.ReserveReply, err error) {
		if err != nil {
			t.Fatalf("reserve after a load that did not reach this server: %v", err)
		}
	})
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
