package rls

import (
	"context"
	"fmt"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/auth"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/grpcapi"
	"quotaflow/services/admission/internal/rlsconf"
)

// TestLateGiveBackLeavesTheNextWindow: a response-time call decides to
// give an estimate back while the estimate's window is current (more than
// windowGuard before its end, by this host's clock), but Redis runs the
// give back after that window ended: a stall around the window's end, a
// correction that timed out here yet ran there, or the moves of a call's
// many counters made one after another. The give back must then leave the
// next window alone (the estimate went with its window), as CountBatch's
// own give back, dated in its decision's window, does; it must not erase
// what the next window's requests were charged, which is credit no caller
// was ever charged for (docs/design.md §4: "an actual of 0 gives back at
// most the estimate, in the window it was charged in, once").
//
// Two Deciders on one Redis stand for Redis's time then and later: the
// request-time call's, 5 s before a minute's end, and the give back's,
// 1 s into the next minute.
func TestLateGiveBackLeavesTheNextWindow(t *testing.T) {
	c := redistest.Shared(t)
	const w = time.Minute
	then := w - 5*time.Second - time.Duration(time.Now().UnixNano()%int64(w))
	later := then + 6*time.Second
	decider := func(offset time.Duration) *decide.Decider {
		d, err := decide.New(limits.New(c, limits.Options{NoEpochGuard: true, ClockOffset: offset}),
			func() *policy.Policy { return nil }, decide.Options{RedisTimeout: 2 * time.Second}, nil, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Close(context.Background()) })
		return d
	}
	now, next := decider(then), decider(later)
	domain := redistest.UniqueName(t)
	cfg, err := rlsconf.Parse(rlsconf.File{Name: "late.yaml", Data: []byte(fmt.Sprintf(`domain: %s
descriptors:
  - key: path
    value: /x
    rate_limit: {unit: minute, requests_per_unit: 100}
`, domain))})
	if err != nil {
		t.Fatal(err)
	}
	handler := func(check Checker, correct Corrector) *Handler {
		o := Options{Checker: check, Config: func() *rlsconf.Config { return cfg }}
		if correct != nil {
			o.RequestIDKey, o.ActualIDKey, o.Corrector, o.Records = "request_id", "actual_id", correct, c
			o.RecordTimeout, o.RecordTTL = 2*time.Second, time.Hour
		}
		h, err := New(o)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	// The request-time call is decided then; its response-time call's give
	// back runs later. Calls without an id in the next minute: plain.
	ids, plain := handler(now, next), handler(next, nil)
	tokens, err := auth.New(auth.Options{Tokens: []string{"gw#gateway"}})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := tokens.AuthenticateHeader("Bearer gw")
	ctx := grpcapi.NewContext(context.Background(), p.As(auth.Gateway))
	call := func(h *Handler, hits uint64, kv ...string) *rlspb.RateLimitResponse {
		t.Helper()
		d := &rlv3.RateLimitDescriptor{HitsAddend: wrapperspb.UInt64(hits)}
		for i := 0; i < len(kv); i += 2 {
			d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
		}
		resp, err := h.ShouldRateLimit(ctx, &rlspb.RateLimitRequest{Domain: domain, Descriptors: []*rlv3.RateLimitDescriptor{d}})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	if got := call(ids, 40, "path", "/x", "request_id", "r1").GetStatuses()[0].GetLimitRemaining(); got != 60 {
		t.Fatalf("estimate of 40: remaining %d, want 60", got)
	}
	if got := call(plain, 30, "path", "/x").GetStatuses()[0].GetLimitRemaining(); got != 70 {
		t.Fatalf("30 hits in the next minute: remaining %d, want 70", got)
	}
	call(ids, 0, "path", "/x", "actual_id", "r1") // an actual of 0
	if got := call(plain, 0, "path", "/x").GetStatuses()[0].GetLimitRemaining(); got != 70 {
		t.Errorf("the next minute after the estimate's late give back: remaining %d, want 70 (its 30 hits still counted)", got)
	}
}
