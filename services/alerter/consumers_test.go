package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/detect"
)

// The alerter is handed the messages of the types it reads alone: the
// actual events, most of the stream's messages, never reach it.
func TestAlerterNotHandedActualEvents(t *testing.T) {
	e := newEnv(t, opsHook)
	e.start(nil)
	ctx := context.Background()
	now := time.Now().UTC()
	act := events.NewActual("svc", events.Actual{RequestID: "r1", Tenant: "acme", User: "u1", InputTokens: 10, OutputTokens: 5}, now)
	act.Time = now
	e.publish(act, reserved("acme", "u1", "r1", 1, 0, now, userLimit(850, 60))) // two messages: actual, reserved
	e2e.Eventually(t, "the 80 % alert", func() bool { return len(e.recv.of(detect.KindThreshold)) == 1 })

	str, err := e.js.Stream(ctx, e.cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	delivered := map[string]uint64{}
	names := str.ConsumerNames(ctx)
	for name := range names.Name() {
		if name != e.cfg.Consumer && !strings.HasPrefix(name, e.cfg.Consumer+"-") {
			continue
		}
		c, err := str.Consumer(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		delivered[name] = c.CachedInfo().Delivered.Consumer
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, d := range delivered {
		n += d
	}
	if n != 1 {
		t.Errorf("the alerter's consumers were handed %d messages (%v), want 1: the reserved event's alone", n, delivered)
	}
}
