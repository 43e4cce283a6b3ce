package stream_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// These tests run against the real NATS server (natstest.URL; Debian's
// nats-server 2.9 on the development machines), or an embedded one where
// they stop it. Each test owns a stream pair and subject prefix and deletes
// them; none touches the default QUOTAFLOW_USAGE stream.

// testStreams are streams of the test's own on js, redelivering fast
// (AckWait fastAckWait).
func testStreams(t *testing.T, js jetstream.JetStream) stream.Config {
	t.Helper()
	return streamsWith(t, js, fastAckWait)
}

const fastAckWait = 300 * time.Millisecond

// streamsWith is testStreams with the given AckWait.
func streamsWith(t *testing.T, js jetstream.JetStream, ackWait time.Duration) stream.Config {
	t.Helper()
	return natstest.Streams(t, js, "stream", stream.Config{MaxDeliver: 3, AckWait: ackWait})
}

// connect connects to url as the test.
func connect(t *testing.T, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return natstest.Connect(t, url, append([]nats.Option{nats.Timeout(2 * time.Second), nats.Name(t.Name())}, opts...)...)
}

// realNATS connects to the shared server and returns a Config of streams
// and a prefix no other test uses.
func realNATS(t *testing.T) (jetstream.JetStream, stream.Config) {
	t.Helper()
	return realNATSWith(t, fastAckWait)
}

// realNATSWith is realNATS with the given AckWait.
func realNATSWith(t *testing.T, ackWait time.Duration) (jetstream.JetStream, stream.Config) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs NATS")
	}
	_, js := connect(t, natstest.URL())
	return js, streamsWith(t, js, ackWait)
}

func TestEnsure(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// Again, unchanged: idempotent.
	if err := stream.Ensure(ctx, js, cfg); err != nil {
		t.Fatalf("Ensure again = %v", err)
	}
	s, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	got := s.CachedInfo().Config
	if len(got.Subjects) != 1 || got.Subjects[0] != events.UsageSubjects(cfg.SubjectPrefix) ||
		got.Duplicates != cfg.Duplicates || got.MaxAge != cfg.MaxAge || got.Storage != jetstream.FileStorage {
		t.Errorf("usage stream config = subjects %v dup %v age %v storage %v", got.Subjects, got.Duplicates, got.MaxAge, got.Storage)
	}
	d, err := js.Stream(ctx, cfg.DLQStream)
	if err != nil {
		t.Fatal(err)
	}
	if got := d.CachedInfo().Config; len(got.Subjects) != 1 || got.Subjects[0] != events.DLQSubjects(cfg.SubjectPrefix) || got.MaxAge != cfg.DLQMaxAge {
		t.Errorf("dlq stream config = subjects %v age %v", got.Subjects, got.MaxAge)
	}

	// A changed setting is applied in place.
	cfg2 := cfg
	cfg2.MaxAge = 20 * time.Minute
	if err := stream.Ensure(ctx, js, cfg2); err != nil {
		t.Fatalf("Ensure(longer max age) = %v", err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.MaxAge != cfg2.MaxAge {
		t.Errorf("max age after update = %v, want %v", info.Config.MaxAge, cfg2.MaxAge)
	}

	bad := cfg
	bad.Duplicates = time.Hour
	if err := stream.Ensure(ctx, js, bad); err == nil {
		t.Error("Ensure(duplicates > max age) = nil, want an error")
	}
}

func TestPublishDedup(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := stream.NewPublisher(js, cfg)

	act := exampleOf(t, events.TypeActual)
	for i := range 3 {
		if err := p.Publish(ctx, act); err != nil {
			t.Fatalf("Publish #%d = %v", i, err)
		}
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != 1 {
		t.Fatalf("after publishing one event 3 times the stream holds %d, want 1", n)
	}

	// The same event rebuilt later (a retry after a crash) has the same id;
	// a top-up with the same reference dedups even with another amount.
	again := events.NewActual("other-host", act.Data.(events.Actual), testNow.Add(time.Minute))
	top := exampleOf(t, events.TypeTopUp)
	td := top.Data.(events.TopUp)
	td.Amount = 1
	topAgain := events.NewTopUp("quotaflow/admission", td, testNow.Add(time.Hour))
	// Same request, other event types, and another request: all distinct.
	other := act.Data.(events.Actual)
	other.RequestID = "r-999"
	otherEv := events.NewActual("s", other, testNow)
	evs := append([]events.Event{otherEv}, oneOfEach()...)
	evs = append(evs, again, topAgain)
	if err := p.PublishBatch(ctx, evs); err != nil {
		t.Fatalf("PublishBatch = %v", err)
	}
	// PublishBatch sends an id once (the first event of it); JetStream
	// dedups messages, so an event in two messages is stored twice
	// (consumers dedup by id).
	if ids := natstest.StreamEvents(t, js, cfg.Stream); len(ids) != 7 || ids[act.ID] != 2 || ids[top.ID] != 1 {
		t.Errorf("stream holds %v, want 7 event ids (6 examples + r-999), the actual twice (alone, then in a batch)", ids)
	}

	// Each subject got one message: the actual's two events in a batch,
	// each other type's event alone, as Publish sends it.
	batches := map[string][]string{events.TypeActual: {otherEv.ID, act.ID}}
	s, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != 1+6 {
		t.Errorf("stream holds %d messages, want 7 (the first actual, then one per subject)", n)
	}
	for _, ev := range oneOfEach() {
		m, err := s.GetLastMsgForSubject(ctx, events.Subject(cfg.SubjectPrefix, ev.Type()))
		if err != nil {
			t.Fatalf("last msg on %s: %v", ev.Type(), err)
		}
		id, ct := m.Header.Get(jetstream.MsgIDHeader), m.Header.Get("Content-Type")
		if want, ok := batches[ev.Type()]; ok {
			data, err := stream.Payload(m.Header, m.Data)
			if err != nil {
				t.Fatalf("%s batch: %v", ev.Type(), err)
			}
			got, errs, _, err := events.DecodeBatch(data)
			if err != nil || len(got) != len(want) {
				t.Fatalf("%s batch = %v, %v; want ids %v", ev.Type(), got, err, want)
			}
			for i := range want {
				if errs[i] != nil || got[i].ID != want[i] {
					t.Errorf("%s batch[%d] = %s, %v; want %s", ev.Type(), i, got[i].ID, errs[i], want[i])
				}
			}
			if id != events.BatchID(want) || ct != events.BatchContentType {
				t.Errorf("%s batch stored with Nats-Msg-Id %q, Content-Type %q", ev.Type(), id, ct)
			}
			continue
		}
		if id != ev.ID {
			t.Errorf("%s stored with Nats-Msg-Id %q, want %q", ev.Type(), id, ev.ID)
		}
		if ct != events.ContentType {
			t.Errorf("%s stored with Content-Type %q", ev.Type(), ct)
		}
		got, err := events.Decode(m.Data)
		if err != nil {
			t.Errorf("Decode(stored %s) = %v", ev.Type(), err)
		} else if got.ID != ev.ID {
			t.Errorf("stored %s has id %s, want %s", ev.Type(), got.ID, ev.ID)
		}
	}
}

func TestPublishBatchErrors(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := stream.NewPublisher(js, cfg)

	bad := exampleOf(t, events.TypeActual)
	d := bad.Data.(events.Actual)
	d.InputTokens = -1
	bad.Data = d
	if err := p.Publish(ctx, bad); !errors.Is(err, events.ErrInvalid) || !strings.Contains(err.Error(), "data.input_tokens: must be >= 0") {
		t.Errorf("Publish(invalid) = %v, want events.ErrInvalid about input_tokens", err)
	}

	evs := oneOfEach()
	evs[2] = bad
	err := p.PublishBatch(ctx, evs)
	var be *stream.BatchError
	if !errors.As(err, &be) || len(be.Errs) != len(evs) {
		t.Fatalf("PublishBatch(one invalid) = %v, want a *stream.BatchError of %d", err, len(evs))
	}
	for i, e := range be.Errs {
		if (e != nil) != (i == 2) {
			t.Errorf("Errs[%d] = %v", i, e)
		}
	}
	if !errors.Is(err, events.ErrInvalid) {
		t.Errorf("PublishBatch error %v does not wrap events.ErrInvalid", err)
	}
	if ids := natstest.StreamEvents(t, js, cfg.Stream); len(ids) != len(evs)-1 || ids[bad.ID] != 0 {
		t.Errorf("stream holds %v, want the %d valid events", ids, len(evs)-1)
	}

	// A publisher whose prefix belongs to no stream gets an error per
	// event, not a hang.
	lost := stream.NewPublisher(js, stream.Config{Stream: cfg.Stream, SubjectPrefix: cfg.SubjectPrefix + "_nowhere"})
	short, cancel2 := context.WithTimeout(ctx, time.Second)
	defer cancel2()
	if err := lost.PublishBatch(short, oneOfEach()[:2]); !errors.As(err, &be) || be.Errs[0] == nil || be.Errs[1] == nil {
		t.Errorf("PublishBatch(no stream) = %v, want both failed", err)
	}
	// A prefix that lands in another stream fails the expected-stream check.
	other := stream.NewPublisher(js, stream.Config{Stream: cfg.Stream + "_OTHER", SubjectPrefix: cfg.SubjectPrefix})
	if err := other.Publish(ctx, exampleOf(t, events.TypeReleased)); err == nil {
		t.Error("Publish to a prefix of another stream = nil, want an error")
	}
	if err := p.Flush(ctx); err != nil {
		t.Errorf("Flush = %v", err)
	}
}

// TestPublishBatchFitsTheStreamLimit plays an older service's Ensure,
// which sets the stream's MaxMsgSize to DefaultMaxPayload, below the
// server's max payload the Publisher packs for: PublishBatch learns the
// stream's limit from its refusal and stores every event once, in batches
// under it, then packs to it from the start.
func TestPublishBatchFitsTheStreamLimit(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := olderStreamLimit(ctx, t, js, cfg)

	first := actuals(1000, "older") // ~200 KB of events: several messages of 68 KiB
	if err := p.PublishBatch(ctx, first); err != nil {
		t.Fatalf("PublishBatch under an older stream limit = %v, want nil", err)
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for _, ev := range first {
		if ids[ev.ID] != 1 {
			t.Fatalf("event %s stored %d times, want once", ev.ID, ids[ev.ID])
		}
	}
	msgs := natstest.StreamMsgs(t, js, cfg.Stream)
	if msgs < 3 || msgs > 10 {
		t.Errorf("%d events in %d messages, want batches of about 64 KiB", len(first), msgs)
	}
	if err := p.PublishBatch(ctx, actuals(1000, "again")); err != nil {
		t.Fatalf("PublishBatch after learning the limit = %v, want nil", err)
	}
	if got := natstest.StreamMsgs(t, js, cfg.Stream) - msgs; got != msgs {
		t.Errorf("the same events again took %d messages, want %d", got, msgs)
	}
}

// Once the rolling upgrade ends and a newer Ensure raised the stream's
// limit again, the Publisher packs to the server's max payload again
// within RefitAfter rounds, without a message refused on the way; before
// that, rounds read the lowered limit and keep to it.
func TestPublishBatchRecoversTheServerLimit(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p := olderStreamLimit(ctx, t, js, cfg)
	if err := p.PublishBatch(ctx, actuals(1000, "older")); err != nil {
		t.Fatalf("PublishBatch under an older stream limit = %v, want nil", err)
	}
	// Rounds of one event under the older limit: the budget stays low
	// (checked below by a large round's messages).
	for i := range stream.RefitAfter {
		if err := p.PublishBatch(ctx, actuals(1, fmt.Sprintf("still-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	msgs := natstest.StreamMsgs(t, js, cfg.Stream)
	if err := p.PublishBatch(ctx, actuals(1000, "lowered")); err != nil {
		t.Fatal(err)
	}
	lowered := natstest.StreamMsgs(t, js, cfg.Stream) - msgs
	if lowered < 3 {
		t.Fatalf("1000 events under the older limit took %d messages, want batches of about 64 KiB", lowered)
	}

	if err := stream.Ensure(ctx, js, cfg); err != nil { // the newer service's
		t.Fatal(err)
	}
	for i := range stream.RefitAfter {
		if err := p.PublishBatch(ctx, actuals(1, fmt.Sprintf("raised-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	msgs = natstest.StreamMsgs(t, js, cfg.Stream)
	big := actuals(1000, "recovered") // ~200 KB: one message under 1 MiB
	if err := p.PublishBatch(ctx, big); err != nil {
		t.Fatalf("PublishBatch after the stream's limit rose = %v, want nil", err)
	}
	if got := natstest.StreamMsgs(t, js, cfg.Stream) - msgs; got != 1 {
		t.Errorf("1000 events after the stream's limit rose took %d messages, want 1 (%d under the older limit)", got, lowered)
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for _, ev := range big {
		if ids[ev.ID] != 1 {
			t.Fatalf("event %s stored %d times, want once", ev.ID, ids[ev.ID])
		}
	}
}

// streamHook is a real jetstream.JetStream whose next Stream read, once
// armed, runs after before returning its (by then stale) info.
type streamHook struct {
	jetstream.JetStream
	after atomic.Pointer[func()]
}

func (h *streamHook) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := h.JetStream.Stream(ctx, name)
	if f := h.after.Swap(nil); f != nil {
		(*f)()
	}
	return s, err
}

// A refit that read the raised limit just before a concurrent round was
// refused under a limit lowered again (and lowered the budget to it) does
// not raise the budget back: the next round would be refused again
// (review finding). The hook runs the refusal between the refit's read
// and its update.
func TestPublishBatchRefitKeepsAConcurrentLowering(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	setStreamLimit(ctx, t, js, cfg, stream.DefaultMaxPayload) // an older service's
	h := &streamHook{JetStream: js}
	p := stream.NewPublisher(h, cfg, stream.WithMaxPayload(1<<20), stream.WithCompression(false))
	if err := p.PublishBatch(ctx, actuals(1000, "older")); err != nil {
		t.Fatal(err)
	}
	if got, want := p.Budget(), stream.BudgetFor(stream.DefaultMaxPayload); got != want {
		t.Fatalf("budget under the older limit %d, want %d", got, want)
	}
	if err := stream.Ensure(ctx, js, cfg); err != nil { // a newer service raises it
		t.Fatal(err)
	}
	const lowest = stream.DefaultMaxPayload / 2
	var refused error
	fired := false
	f := func() {
		fired = true
		setStreamLimit(ctx, t, js, cfg, lowest)
		refused = p.PublishBatch(ctx, actuals(1000, "refused"))
	}
	h.after.Store(&f)
	for i := 0; !fired && i <= stream.RefitAfter; i++ {
		if err := p.PublishBatch(ctx, actuals(1, fmt.Sprintf("round-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	if !fired || refused != nil {
		t.Fatalf("refit read the stream: %v; the concurrent round = %v, want nil", fired, refused)
	}
	if got, want := p.Budget(), stream.BudgetFor(lowest); got != want {
		t.Errorf("budget after the refit %d, want %d: the stale read of the raised limit undid the lowering", got, want)
	}
}

// setStreamLimit sets the stream's MaxMsgSize.
func setStreamLimit(ctx context.Context, t *testing.T, js jetstream.JetStream, cfg stream.Config, max int32) {
	t.Helper()
	s, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	sc := s.CachedInfo().Config
	sc.MaxMsgSize = max
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
}

// olderStreamLimit sets the stream's MaxMsgSize to what an older service's
// Ensure sets and returns a Publisher that packs to the server's 1 MiB
// without compressing (compressed, these actual events would fit 68 KiB:
// the stream's refusal of a batch too large is what the tests take on).
func olderStreamLimit(ctx context.Context, t *testing.T, js jetstream.JetStream, cfg stream.Config) *stream.Publisher {
	t.Helper()
	setStreamLimit(ctx, t, js, cfg, stream.DefaultMaxPayload)
	return stream.NewPublisher(js, cfg, stream.WithMaxPayload(1<<20), stream.WithCompression(false))
}

// Rounds refused at once for their size are each sent again, though only
// one of them lowers the Publisher's budget (review finding: the others
// returned the refusal, a report's 503).
func TestPublishBatchFitsTheStreamLimitConcurrently(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p := olderStreamLimit(ctx, t, js, cfg)
	rounds := make([][]events.Event, 8)
	errs := make([]error, len(rounds))
	var wg sync.WaitGroup
	for i := range rounds {
		rounds[i] = actuals(1000, fmt.Sprintf("round%d", i))
		wg.Go(func() { errs[i] = p.PublishBatch(ctx, rounds[i]) })
	}
	wg.Wait()
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for i, round := range rounds {
		if errs[i] != nil {
			t.Errorf("round %d: PublishBatch = %v, want nil", i, errs[i])
		}
		for _, ev := range round {
			if ids[ev.ID] != 1 {
				t.Fatalf("event %s stored %d times, want once", ev.ID, ids[ev.ID])
			}
		}
	}
}

func TestConsumeAndDeadLetter(t *testing.T) {
	js, cfg := realNATS(t)
	// Redeliveries come from the handler's naks alone: with the suite's
	// 300 ms AckWait a loaded host let a delivery's ack wait pass, and the
	// poison came a fourth time (dead-lettered 3, attempts 4), and at load
	// 15 so did 3 s (session 10: delivered 4 times; dead-lettered 2,
	// attempts 2). Naks back off 1 s, then 2 s.
	cfg.AckWait = 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p := stream.NewPublisher(js, cfg)

	// Published before the consumer exists: DeliverAll must still see it.
	good := current(exampleOf(t, events.TypeActual))
	if err := p.Publish(ctx, good); err != nil {
		t.Fatal(err)
	}
	// A malformed event straight onto the subject, as a buggy service
	// in another language might.
	malformed := []byte(`{"specversion":"1.0","type":"quotaflow.usage.actual","data":{"input_tokens":-1}}`)
	if _, err := js.Publish(ctx, events.Subject(cfg.SubjectPrefix, events.TypeActual), malformed, jetstream.WithMsgID("bad-1")); err != nil {
		t.Fatal(err)
	}
	// A valid event whose handler always fails: dead-lettered after
	// MaxDeliver (3) deliveries.
	poison := current(exampleOf(t, events.TypeReleased))
	if err := p.Publish(ctx, poison); err != nil {
		t.Fatal(err)
	}
	// The accounter ignores its own corrections: a nil handler acks them.
	if err := p.Publish(ctx, current(exampleOf(t, events.TypeCorrected))); err != nil {
		t.Fatal(err)
	}

	var cons jetstream.Consumer
	for range 2 { // idempotent
		var err error
		if cons, err = stream.EnsureConsumer(ctx, js, cfg, "worker"); err != nil {
			t.Fatalf("EnsureConsumer = %v", err)
		}
	}
	ci := cons.CachedInfo().Config
	if ci.FilterSubject != events.UsageSubjects(cfg.SubjectPrefix) || ci.DeliverPolicy != jetstream.DeliverAllPolicy ||
		ci.AckPolicy != jetstream.AckExplicitPolicy || ci.AckWait != cfg.AckWait {
		t.Errorf("consumer config = %+v", ci)
	}

	var mu sync.Mutex
	var handled []string
	attempts := 0
	h := &stream.Handlers{
		Actual: func(_ context.Context, ev events.Event, d events.Actual) error {
			mu.Lock()
			defer mu.Unlock()
			handled = append(handled, ev.ID)
			return nil
		},
		Released: func(context.Context, events.Event, events.Released) error {
			mu.Lock()
			defer mu.Unlock()
			attempts++
			return errors.New("ledger unavailable")
		},
	}
	// One long-lived subscription, not a Fetch per turn: a delivery that
	// reached an expired Fetch was lost to the test and came back only
	// after AckWait, one delivery short (CI: dead-lettered 2, retried 1,
	// attempts 2).
	msgs, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	defer msgs.Stop()
	var dead, retried int
	for deadline := time.Now().Add(15 * time.Second); dead < 2 && time.Now().Before(deadline); {
		msg, err := msgs.Next(jetstream.NextMaxWait(500 * time.Millisecond))
		if errors.Is(err, nats.ErrTimeout) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		switch err := stream.Process(ctx, js, cfg, msg, h.Dispatch); {
		case err == nil:
		case errors.Is(err, stream.ErrDeadLettered):
			dead++
		default:
			retried++
		}
	}
	if dead != 2 || retried != cfg.MaxDeliver-1 || attempts != cfg.MaxDeliver {
		t.Errorf("dead-lettered %d, retried %d, attempts %d; want 2, %d, %d", dead, retried, attempts, cfg.MaxDeliver-1, cfg.MaxDeliver)
	}
	if len(handled) != 1 || handled[0] != good.ID {
		t.Errorf("handled %v, want [%s]", handled, good.ID)
	}

	dlq, err := js.Stream(ctx, cfg.DLQStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := dlq.GetLastMsgForSubject(ctx, events.DLQSubject(cfg.SubjectPrefix, stream.ReasonInvalid))
	if err != nil {
		t.Fatalf("invalid dead letter: %v", err)
	}
	if string(m.Data) != string(malformed) ||
		!strings.Contains(m.Header.Get(stream.HeaderError), "data.input_tokens: must be >= 0") ||
		m.Header.Get(stream.HeaderSubject) != events.Subject(cfg.SubjectPrefix, events.TypeActual) ||
		m.Header.Get(stream.HeaderStream) != cfg.Stream || m.Header.Get(stream.HeaderMsgID) != "bad-1" ||
		m.Header.Get(stream.HeaderSequence) != "2" || m.Header.Get(stream.HeaderDelivered) != "1" {
		t.Errorf("invalid dead letter = %q %v", m.Data, m.Header)
	}
	m, err = dlq.GetLastMsgForSubject(ctx, events.DLQSubject(cfg.SubjectPrefix, stream.ReasonMaxDeliver))
	if err != nil {
		t.Fatalf("max_deliver dead letter: %v", err)
	}
	if e := m.Header.Get(stream.HeaderError); !strings.Contains(e, "ledger unavailable") || !strings.Contains(e, "delivered 3 times") ||
		m.Header.Get(stream.HeaderMsgID) != poison.ID {
		t.Errorf("max_deliver dead letter headers = %v", m.Header)
	}

	// Nothing is left pending or stranded.
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 0 || info.NumPending != 0 || info.NumRedelivered != 0 {
		t.Errorf("consumer after processing: pending %d, ack pending %d, redelivered %d", info.NumPending, info.NumAckPending, info.NumRedelivered)
	}

	// The ledger is back: the poison event is replayed from the dead-letter
	// stream to its subject and handled once; the malformed one stays.
	for i, want := range []int{1, 0} {
		n, err := stream.Replay(ctx, js, cfg, stream.ReasonMaxDeliver)
		if err != nil || n != want {
			t.Fatalf("Replay #%d = %d, %v; want %d", i, n, err, want)
		}
	}
	if _, err := dlq.GetLastMsgForSubject(ctx, events.DLQSubject(cfg.SubjectPrefix, stream.ReasonMaxDeliver)); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Errorf("replayed dead letter still in the dead-letter stream: %v", err)
	}
	if _, err := dlq.GetLastMsgForSubject(ctx, events.DLQSubject(cfg.SubjectPrefix, stream.ReasonInvalid)); err != nil {
		t.Errorf("the malformed dead letter was replayed too: %v", err)
	}
	var released []string
	h.Released = func(_ context.Context, ev events.Event, _ events.Released) error {
		released = append(released, ev.ID)
		return nil
	}
	for deadline := time.Now().Add(10 * time.Second); len(released) == 0 && time.Now().Before(deadline); {
		msg, err := msgs.Next(jetstream.NextMaxWait(500 * time.Millisecond))
		if errors.Is(err, nats.ErrTimeout) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Process(ctx, js, cfg, msg, h.Dispatch); err != nil {
			t.Fatalf("replayed event: %v", err)
		}
	}
	if len(released) != 1 || released[0] != poison.ID {
		t.Errorf("after replay the consumer handled %v, want [%s]", released, poison.ID)
	}

	// Dead-lettering the same stream message again (a crash before Term)
	// stores it once.
	if _, err := js.Publish(ctx, events.Subject(cfg.SubjectPrefix, events.TypeActual), malformed, jetstream.WithMsgID("bad-2")); err != nil {
		t.Fatal(err)
	}
	// From the same subscription: a Fetch beside it could lose the message
	// to a pull request of the subscription's still open at the server.
	msg, err := msgs.Next(jetstream.NextMaxWait(5 * time.Second))
	if err != nil {
		t.Fatalf("bad-2: %v", err)
	}
	before := natstest.StreamMsgs(t, js, cfg.DLQStream)
	for range 2 {
		if err := stream.DeadLetter(ctx, js, cfg, "manual", msg, fmt.Errorf("twice")); err != nil {
			t.Fatal(err)
		}
	}
	_ = msg.Term()
	if n := natstest.StreamMsgs(t, js, cfg.DLQStream); n != before+1 {
		t.Errorf("DLQ holds %d after dead-lettering one message twice, want %d", n, before+1)
	}
}

func TestProcessShutdownRedelivers(t *testing.T) {
	js, cfg := realNATS(t)
	cfg.MaxDeliver = 1 // a failure would dead-letter at once, but shutdown must not
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := stream.NewPublisher(js, cfg).Publish(ctx, current(exampleOf(t, events.TypeActual))); err != nil {
		t.Fatal(err)
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	fetch := func() jetstream.Msg {
		t.Helper()
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for msg := range batch.Messages() {
			return msg
		}
		t.Fatal("no message")
		return nil
	}

	stopping, stop := context.WithCancel(ctx)
	stop()
	err = stream.Process(stopping, js, cfg, fetch(), func(ctx context.Context, _ events.Event) error { return ctx.Err() })
	if err == nil || errors.Is(err, stream.ErrDeadLettered) {
		t.Fatalf("Process during shutdown = %v, want a retryable error", err)
	}
	msg := fetch() // nak'ed without delay: back at once
	if md, _ := msg.Metadata(); md.NumDelivered != 2 {
		t.Errorf("redelivery has NumDelivered %d, want 2", md.NumDelivered)
	}
	if err := stream.Process(ctx, js, cfg, msg, func(context.Context, events.Event) error { return nil }); err != nil {
		t.Errorf("Process = %v", err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.DLQStream); n != 0 {
		t.Errorf("DLQ holds %d, want 0", n)
	}
}

// Replay without a reason replays the dead letters of every reason.
func TestReplayEveryReason(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs := oneOfEach()[2:4] // an actual and a released
	if err := stream.NewPublisher(js, cfg).PublishBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(2, jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	reasons := []string{"one", "two"}
	for msg := range batch.Messages() {
		if err := stream.Reject(ctx, js, cfg, reasons[0], msg, errors.New("test")); !errors.Is(err, stream.ErrDeadLettered) {
			t.Fatalf("Reject = %v, want ErrDeadLettered", err)
		}
		reasons = reasons[1:]
	}
	if len(reasons) != 0 {
		t.Fatalf("fetched %d of 2 messages", 2-len(reasons))
	}
	if n, err := stream.Replay(ctx, js, cfg, ""); err != nil || n != 2 {
		t.Errorf(`Replay(every reason) = %d, %v; want 2`, n, err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.DLQStream); n != 0 {
		t.Errorf("the dead-letter stream holds %d after the replay, want 0", n)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != 4 {
		t.Errorf("the usage stream holds %d after the replay, want 4 (2 replayed)", n)
	}
}
