package decide

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Concurrent admissions of one user go to Redis in shared batches and are
// still exact: of 640 racing requests against a limit of 100, exactly 100
// are admitted, Redis counts 100, and every Reserve call went through a
// batch.
func TestConcurrentAdmitsAreExactThroughBatches(t *testing.T) {
	const pol = `
default_plan: free
plans:
  free:
    rates: [{name: n, kind: fixed, window: 1h, limit: 100}]
`
	c := redistest.Shared(t)
	tenant := newTenant(t)
	p := parsePolicy(t, pol, "")
	d := newDecider(t, c, p, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})

	const workers, each = 32, 20
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range each {
				r, err := d.Admit(context.Background(), in(tenant, "u", "/e", 1))
				if err != nil || r.Local {
					t.Errorf("Admit = %+v, %v; want a Redis decision", r, err)
					return
				}
				if r.Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if allowed.Load() != 100 {
		t.Fatalf("admitted %d of %d racing requests, want exactly 100", allowed.Load(), workers*each)
	}
	rs, _ := p.Resolve(tenant, "", "/e")
	dec, err := d.lim.Peek(context.Background(), limits.Request{Tenant: tenant, User: "u", Rules: rs.Subject, Counted: rs.Counted})
	if err != nil {
		t.Fatal(err)
	}
	if used := dec.States[0].Used; used != 100 {
		t.Fatalf("redis used = %d, want 100", used)
	}
	var m dto.Metric
	if err := d.m.batchSize.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetHistogram().GetSampleSum(); got != workers*each {
		t.Fatalf("reserve calls batched = %v, want %d", got, workers*each)
	}
}

// queued returns a batcher and one queued reservation of a fresh user per
// deadline, and a reader of how many of them Redis counted.
func queued(t *testing.T, deadlines ...time.Time) (b *batcher[limits.Request], batch []*pending[limits.Request], used func() int64) {
	lim := limits.New(redistest.Shared(t), limits.Options{NoEpochGuard: true})
	b = newBatcher(lim.ReserveBatch, prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x"}))
	tenant := newTenant(t)
	rules := []policy.Rule{{Scope: policy.ScopeUser, Limit: policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 10, Window: policy.Duration(time.Hour)}}}
	for i, dl := range deadlines {
		batch = append(batch, &pending[limits.Request]{
			deadline: dl, done: make(chan struct{}, 1),
			req: limits.Request{Tenant: tenant, User: "u", RequestID: fmt.Sprint(i), Cost: 1, Rules: rules},
		})
	}
	used = func() int64 {
		dec, err := lim.Peek(context.Background(), limits.Request{Tenant: tenant, User: "u", Rules: rules})
		if err != nil {
			t.Fatal(err)
		}
		return dec.States[0].Used
	}
	return b, batch, used
}

// A call whose deadline passed while it was queued is answered
// context.DeadlineExceeded and never sent; the others of its batch are.
func TestBatchSkipsCallsPastTheirDeadline(t *testing.T) {
	now := time.Now()
	b, batch, used := queued(t, now.Add(time.Minute), now.Add(-time.Millisecond), now.Add(time.Minute))
	b.send(expire(batch, time.Now()))
	for i, r := range batch {
		<-r.done
		expired := i == 1
		if expired != errors.Is(r.out.Err, context.DeadlineExceeded) || !expired && (r.out.Err != nil || !r.out.Decision.Allowed) {
			t.Errorf("call %d (expired %v): %+v, %v", i, expired, r.out.Decision, r.out.Err)
		}
	}
	if n := used(); n != 2 {
		t.Fatalf("redis used = %d, want 2 (the expired call not sent)", n)
	}
}

// A caller whose deadline passed while queued, and whose turn it is to send
// its batch, returns at once: the first live caller of the batch sends it.
func TestExpiredLeadHandsItsBatchOn(t *testing.T) {
	now := time.Now()
	b, batch, used := queued(t, now.Add(-time.Millisecond), now.Add(time.Minute), now.Add(time.Minute))
	b.busy = true
	batch[0].lead = batch
	b.lead(batch[0]) // returns without sending
	if !errors.Is(batch[0].out.Err, context.DeadlineExceeded) {
		t.Errorf("expired lead: %v, want DeadlineExceeded", batch[0].out.Err)
	}
	if n := used(); n != 0 {
		t.Fatalf("redis used = %d after the expired lead returned, want 0 (nothing sent by it)", n)
	}
	<-batch[1].done
	if len(batch[1].lead) != 2 || batch[1].lead[0] != batch[1] || batch[1].lead[1] != batch[2] {
		t.Fatalf("the first live caller leads %v, want itself and the third", batch[1].lead)
	}
	b.lead(batch[1])
	<-batch[2].done
	for i, r := range batch[1:] {
		if r.out.Err != nil || !r.out.Decision.Allowed {
			t.Errorf("live call %d: %+v, %v", i+1, r.out.Decision, r.out.Err)
		}
	}
	if n := used(); n != 2 {
		t.Errorf("redis used = %d, want 2", n)
	}
}
