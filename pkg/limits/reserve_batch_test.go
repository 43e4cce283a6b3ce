package limits_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// TestReserveBatchDecidesLikeReserveInOrder sends, in one batch to a fresh
// server (whose empty script cache answers NOSCRIPT first), more requests of
// one user than its limit, a retried request id, an invalid request and
// another user: each outcome is what lone Reserve calls in that order give.
func TestReserveBatchDecidesLikeReserveInOrder(t *testing.T) {
	l := limitstest.At(redistest.Start(t).Client(), 0)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(3600e9)})}
	req := func(user, id string) limits.Request {
		return limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: 1, Rules: rules}
	}
	rs := []limits.Request{req("a", "1"), req("a", "2"), req("a", "3"), req("a", "4"), req("a", "1"), req("", "5"), req("b", "1")}
	type want struct {
		allowed, dup bool
		used         int64
	}
	wants := []want{{true, false, 1}, {true, false, 2}, {true, false, 3}, {false, false, 3}, {true, true, 3}, {}, {true, false, 1}}

	out := l.ReserveBatch(context.Background(), rs)
	if len(out) != len(rs) {
		t.Fatalf("ReserveBatch returned %d outcomes for %d requests", len(out), len(rs))
	}
	for i, o := range out {
		if rs[i].User == "" {
			if !errors.Is(o.Err, limits.ErrInvalid) {
				t.Errorf("ReserveBatch[%d] (no user) error = %v, want ErrInvalid", i, o.Err)
			}
			continue
		}
		if o.Err != nil {
			t.Fatalf("ReserveBatch[%d] error = %v", i, o.Err)
		}
		w, d := wants[i], o.Decision
		if d.Allowed != w.allowed || d.Duplicate != w.dup || d.States[0].Used != w.used {
			t.Errorf("ReserveBatch[%d] (%s/%s) = allowed %v, duplicate %v, used %d; want %v, %v, %d",
				i, rs[i].User, rs[i].RequestID, d.Allowed, d.Duplicate, d.States[0].Used, w.allowed, w.dup, w.used)
		}
		if d.States[0].Rule != &rules[0] {
			t.Errorf("ReserveBatch[%d].States[0].Rule does not point into the request's rules", i)
		}
	}
	if d := limitstest.Peek(t, l, tenant, "a", rules); d.States[0].Used != 3 {
		t.Fatalf("after the batch, user a used %d, want 3", d.States[0].Used)
	}
}

// TestReserveBatchOnClusterSpansNodes batches subjects of many tenants,
// which live on different nodes of a fresh cluster (each with an empty
// script cache); every call is decided, twice.
func TestReserveBatchOnClusterSpansNodes(t *testing.T) {
	cc := redistest.Cluster(t)
	l := limits.New(cc, limits.Options{NoEpochGuard: true})
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * 3600e9)})}
	base := redistest.UniqueName(t)
	var rs []limits.Request
	for i := range 30 {
		rs = append(rs, limits.Request{Tenant: base + strconv.Itoa(i), User: "u", RequestID: "r", Cost: 5, Rules: rules})
	}
	for round, wantUsed := range []int64{5, 10} {
		for i := range rs {
			rs[i].RequestID = "r" + strconv.Itoa(round)
		}
		for i, o := range l.ReserveBatch(context.Background(), rs) {
			if o.Err != nil {
				t.Fatalf("round %d: ReserveBatch[%d] error = %v", round, i, o.Err)
			}
			if !o.Decision.Allowed || o.Decision.States[0].Used != wantUsed {
				t.Fatalf("round %d: ReserveBatch[%d] = allowed %v, used %d; want true, %d",
					round, i, o.Decision.Allowed, o.Decision.States[0].Used, wantUsed)
			}
		}
	}
}

// TestReserveBatchFailsEveryCallWhenRedisIsDown: each outcome carries the
// connection's error, naming its subject.
func TestReserveBatchFailsEveryCallWhenRedisIsDown(t *testing.T) {
	srv := redistest.Start(t)
	l := limitstest.At(srv.Client(), 0)
	srv.Stop()
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(3600e9)})}
	rs := []limits.Request{
		{Tenant: "t", User: "a", RequestID: "1", Rules: rules},
		{Tenant: "t", User: "b", RequestID: "1", Rules: rules},
	}
	for i, o := range l.ReserveBatch(context.Background(), rs) {
		if o.Err == nil || !strings.Contains(o.Err.Error(), "reserve t/"+rs[i].User+": ") {
			t.Errorf("ReserveBatch[%d] error = %v, want a connection error naming t/%s", i, o.Err, rs[i].User)
		}
	}
}
