package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
)

// TestMixedBatchesCountOnceAcrossACrash publishes reserved and actual
// events mixed in batch messages, as admission's outbox sends admits and
// reports together: one through the Publisher (compressed, on the mixed
// subject), one written by hand with a poison event among them. A first
// accounter applies them and "crashes" before any ack; the second, given
// them again, counts each event once and dead-letters the poison alone.
func TestMixedBatchesCountOnceAcrossACrash(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.oneBatch()
	ctx := context.Background()
	ten := "mixed-" + e2e.RandomHex(4)
	const n = 20
	var mixed []events.Event // reserved r0, actual r0, reserved r1, ...
	var want int64
	for i := range n {
		req := fmt.Sprintf("r%d", i)
		d, err := e.lim.Reserve(ctx, limits.Request{Tenant: ten, User: "u1", RequestID: req, Cost: 100, Rules: e.rules(ten)})
		if err != nil || !d.Allowed {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		mixed = append(mixed, events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: "u1", Endpoint: "/api/v1/generate",
			EstimatedTokens: 100, ExpiresAt: time.Now().Add(time.Hour), Version: d.Version,
		}, time.Now()), e.actual(ten, "u1", req, "", int64(10+i), 0))
		want += int64(10 + i)
	}
	if err := e.pub.PublishBatch(ctx, mixed[:n]); err != nil {
		t.Fatal(err)
	}
	if got := e.subjectMsgs(e.cfg.Stream, events.MixedSubject(e.cfg.SubjectPrefix)); got != 1 {
		t.Fatalf("%d messages on the mixed subject, want 1 (the test needs a mixed batch)", got)
	}
	const poisonAt = 3
	parts := make([][]byte, 0, n+1)
	for _, ev := range mixed[n:] {
		b, err := events.Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, b)
	}
	poison := []byte(`{"specversion":"1.0","id":"poison","type":"quotaflow.usage.actual","data":{"input_tokens":-1}}`)
	parts = append(parts[:poisonAt], append([][]byte{poison}, parts[poisonAt:]...)...)
	m := nats.NewMsg(events.MixedSubject(e.cfg.SubjectPrefix))
	m.Data = events.AppendBatch(nil, parts)
	m.Header.Set("Content-Type", events.BatchContentType)
	if _, err := e.js.PublishMsg(ctx, m, jetstream.WithMsgID("mixed-by-hand")); err != nil {
		t.Fatal(err)
	}

	abandoned := make(chan int, 1)
	var first atomic.Bool
	stop := e.start(&hooks{beforeAck: func(size int) error {
		if first.CompareAndSwap(false, true) {
			abandoned <- size
		}
		return errors.New("crash")
	}})
	select {
	case <-abandoned:
	case <-time.After(20 * time.Second):
		t.Fatal("no batch handled")
	}
	stop()
	if got := e.count("SELECT count(*) FROM reservations WHERE tenant=$1", ten); got == 0 {
		t.Fatal("the abandoned batch wrote nothing to the ledger")
	}

	e.start(nil)
	e.consumedAll(ten, n)
	if got := e.count("SELECT count(*) FROM reservations WHERE tenant=$1", ten); got != n {
		t.Errorf("reservations rows = %d, want %d", got, n)
	}
	e.countedOnce(ten, n, want)
	if got := natstest.StreamMsgs(t, e.js, e.cfg.DLQStream); got != 1 {
		t.Fatalf("%d dead letters, want 1 (the poison)", got)
	}
	dlq, err := e.js.Stream(ctx, e.cfg.DLQStream)
	if err != nil {
		t.Fatal(err)
	}
	letter, err := dlq.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if string(letter.Data) != string(poison) || letter.Header.Get(stream.HeaderBatchIndex) != strconv.Itoa(poisonAt) {
		t.Errorf("dead letter %q %v; want the poison alone, batch index %d", letter.Data, letter.Header, poisonAt)
	}
}
