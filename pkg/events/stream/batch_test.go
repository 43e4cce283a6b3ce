package stream_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/klauspost/compress/s2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// actuals returns n current actual events of distinct requests.
func actuals(n int, prefix string) []events.Event {
	evs := make([]events.Event, n)
	for i := range evs {
		evs[i] = events.NewActual("svc", events.Actual{
			RequestID: fmt.Sprintf("%s-%d", prefix, i), Tenant: "acme", User: "u-1", InputTokens: int64(i), OutputTokens: 1,
		}, time.Now().UTC())
	}
	return evs
}

// storedMsgs reads every message of the stream.
func storedMsgs(t *testing.T, js jetstream.JetStream, name string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// PublishBatch packs each subject's events, in order, into messages under
// the max payload; one event alone is a plain CloudEvent; the same batch
// sent again is stored once.
func TestPublishBatchPacks(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const maxPayload = 8 << 10 // 4 KiB of events beside the header room
	p := stream.NewPublisher(js, cfg, stream.WithMaxPayload(maxPayload))

	acts := actuals(40, "pack") // about 300 bytes each: 13 a message
	rel := events.NewReleased("svc", events.Released{RequestID: "r-pack", Tenant: "acme", User: "u-1"}, time.Now().UTC())
	evs := append(append([]events.Event{}, acts[:20]...), rel)
	evs = append(evs, acts[20:]...)
	if err := p.PublishBatch(ctx, evs); err != nil {
		t.Fatalf("PublishBatch = %v", err)
	}
	msgs := storedMsgs(t, js, cfg.Stream)
	var order []string
	released, batches := 0, 0
	for _, m := range msgs {
		if size := len(m.Data) + headerSize(m.Header); size > maxPayload {
			t.Errorf("message %d: %d bytes, over the max payload %d", m.Sequence, size, maxPayload)
		}
		if !events.IsBatch(m.Header.Get("Content-Type")) {
			ev, err := events.Decode(m.Data)
			if err != nil || m.Header.Get(jetstream.MsgIDHeader) != ev.ID || m.Header.Get("Content-Type") != events.ContentType {
				t.Errorf("single message %d: %v, id %q", m.Sequence, err, m.Header.Get(jetstream.MsgIDHeader))
			}
			if ev.ID == rel.ID {
				released++
			} else {
				order = append(order, ev.ID)
			}
			continue
		}
		batches++
		if enc := m.Header.Get(stream.HeaderContentEncoding); enc != stream.EncodingS2 {
			t.Errorf("batch %d: Content-Encoding %q, want %q", m.Sequence, enc, stream.EncodingS2)
		}
		data, err := stream.Payload(m.Header, m.Data)
		if err != nil {
			t.Fatalf("batch %d: %v", m.Sequence, err)
		}
		if len(m.Data) >= len(data)/2 {
			t.Errorf("batch %d: %d bytes compressed from %d, want less than half", m.Sequence, len(m.Data), len(data))
		}
		got, errs, _, err := events.DecodeBatch(data)
		if err != nil {
			t.Fatalf("batch %d: %v", m.Sequence, err)
		}
		var ids []string
		for i, ev := range got {
			if errs[i] != nil || ev.Type() != events.TypeActual {
				t.Errorf("batch %d[%d] = %v, %v; want an actual", m.Sequence, i, ev.Type(), errs[i])
			}
			ids = append(ids, ev.ID)
		}
		order = append(order, ids...)
		if id := m.Header.Get(jetstream.MsgIDHeader); id != events.BatchID(ids) {
			t.Errorf("batch %d has Nats-Msg-Id %q, want %q", m.Sequence, id, events.BatchID(ids))
		}
	}
	if released != 1 || batches < 3 || len(msgs) > 1+5 {
		t.Errorf("released in %d messages, %d batches of %d messages; want 1, at least 3 (40 actuals of ~300 bytes in 4 KiB), at most 5+1",
			released, batches, len(msgs))
	}
	if len(order) != len(acts) {
		t.Fatalf("batches hold %d actuals, want %d", len(order), len(acts))
	}
	for i, ev := range acts {
		if order[i] != ev.ID {
			t.Fatalf("actual %d stored at another place: the order within a subject must hold", i)
		}
	}

	// The same batch again: every message is a duplicate.
	if err := p.PublishBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != uint64(len(msgs)) {
		t.Errorf("after publishing the same batch again the stream holds %d messages, want %d", n, len(msgs))
	}
	// Mixed types in one call: one message per subject.
	mixed := oneOfEach()
	for i := range mixed {
		mixed[i].Time = time.Now().UTC()
	}
	before := natstest.StreamMsgs(t, js, cfg.Stream)
	if err := p.PublishBatch(ctx, append(mixed, actuals(3, "mixed")...)); err != nil {
		t.Fatal(err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != before+uint64(len(mixed)) {
		t.Errorf("mixed types added %d messages, want %d (one per subject)", n-before, len(mixed))
	}
}

// headerSize is the size of h as NATS sends it.
func headerSize(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n
}

// publishRaw publishes data as one message with Content-Type ct, and
// Content-Encoding enc unless it is empty.
func publishRaw(t *testing.T, js jetstream.JetStream, cfg stream.Config, data []byte, ct, enc, id string) {
	t.Helper()
	m := nats.NewMsg(events.Subject(cfg.SubjectPrefix, events.TypeActual))
	m.Data = data
	m.Header.Set("Content-Type", ct)
	if enc != "" {
		m.Header.Set(stream.HeaderContentEncoding, enc)
	}
	if _, err := js.PublishMsg(context.Background(), m, jetstream.WithMsgID(id)); err != nil {
		t.Fatal(err)
	}
}

// fetchOne fetches the next message of cons.
func fetchOne(t *testing.T, cons jetstream.Consumer, wait time.Duration) jetstream.Msg {
	t.Helper()
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(wait))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		return msg
	}
	return nil
}

// Config.Compression (QF_EVENT_COMPRESSION) decides how a Publisher sends
// batches: S2 by default, plain JSON with "none" (while an older consumer
// reads the stream), which WithCompression overrides.
func TestPublishBatchCompressionSetting(t *testing.T) {
	for _, tc := range []struct {
		compression string
		opts        []stream.PublisherOption
		want        string // Content-Encoding
	}{
		{"", nil, stream.EncodingS2},
		{stream.EncodingS2, nil, stream.EncodingS2},
		{stream.CompressionNone, nil, ""},
		{stream.CompressionNone, []stream.PublisherOption{stream.WithCompression(true)}, stream.EncodingS2},
	} {
		t.Run(fmt.Sprintf("%q,%d options", tc.compression, len(tc.opts)), func(t *testing.T) {
			js, cfg := realNATS(t)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cfg.Compression = tc.compression
			acts := actuals(20, "enc")
			if err := stream.NewPublisher(js, cfg, tc.opts...).PublishBatch(ctx, acts); err != nil {
				t.Fatalf("PublishBatch = %v", err)
			}
			msgs := storedMsgs(t, js, cfg.Stream)
			if len(msgs) != 1 {
				t.Fatalf("stored %d messages, want one batch", len(msgs))
			}
			m := msgs[0]
			if enc := m.Header.Get(stream.HeaderContentEncoding); enc != tc.want {
				t.Errorf("Content-Encoding %q, want %q", enc, tc.want)
			}
			data, err := stream.Payload(m.Header, m.Data)
			if err != nil {
				t.Fatal(err)
			}
			if got, _, _, err := events.DecodeBatch(data); err != nil || len(got) != len(acts) {
				t.Errorf("batch of %d events, %v; want %d", len(got), err, len(acts))
			}
		})
	}
}

// A bad event of a batch, compressed or not, is dead-lettered alone, once,
// however often the batch comes back, as a plain single CloudEvent; the
// others are handled; a handler failure naks the whole batch, and at
// MaxDeliver only the failing event is dead-lettered.
func TestBatchDeadLettersPerEvent(t *testing.T) {
	for _, enc := range []string{"", stream.EncodingS2} {
		t.Run("encoding="+enc, func(t *testing.T) { batchDeadLettersPerEvent(t, enc) })
	}
}

func batchDeadLettersPerEvent(t *testing.T, enc string) {
	// AckWait bounds a delivery's Process: one that outlasts it is sent
	// again by right, which read as the batch coming back after its dead
	// letters when realNATS's 300 ms ran out on a loaded host.
	js, cfg := realNATSWith(t, 2*time.Second) // MaxDeliver 3
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	evs := actuals(4, "dl")
	parts := make([][]byte, 0, len(evs)+1)
	for _, ev := range evs {
		b, err := events.Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, b)
	}
	bad := []byte(`{"specversion":"1.0","id":"bad-one","type":"quotaflow.usage.actual","data":{"input_tokens":-1}}`)
	parts = append(parts[:2], append([][]byte{bad}, parts[2:]...)...) // index 2
	data := events.AppendBatch(nil, parts)
	if enc == stream.EncodingS2 {
		data = s2.Encode(nil, data)
	}
	publishRaw(t, js, cfg, data, events.BatchContentType, enc, "raw-batch")
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}

	handled := map[string]int{}
	poison := evs[3].ID // events index 3, batch index 4
	h := &stream.Handlers{Actual: func(_ context.Context, ev events.Event, _ events.Actual) error {
		handled[ev.ID]++
		if ev.ID == poison {
			return errors.New("ledger says no")
		}
		return nil
	}}
	var results []error
	for deliveries := 0; deliveries < cfg.MaxDeliver; {
		msg := fetchOne(t, cons, 5*time.Second)
		if msg == nil {
			t.Fatalf("no redelivery after %d deliveries", deliveries)
		}
		deliveries++
		results = append(results, stream.Process(ctx, js, cfg, msg, h.Dispatch))
	}
	for i, err := range results {
		dead := errors.Is(err, stream.ErrDeadLettered)
		if last := i == len(results)-1; err == nil || dead != last {
			t.Errorf("delivery %d: Process = %v; want a retry, and dead letters on the last", i+1, err)
		}
	}
	for i, ev := range evs {
		if want := cfg.MaxDeliver; handled[ev.ID] != want {
			t.Errorf("event %d handled %d times, want %d (every delivery)", i, handled[ev.ID], want)
		}
	}
	if msg := fetchOne(t, cons, 2*cfg.AckWait); msg != nil {
		t.Errorf("the batch came back after its dead letters: %q", msg.Data())
	}

	// The dead-letter stream holds the bad event once (three deliveries
	// dead-lettered it each time) and the poison event once.
	letters := storedMsgs(t, js, cfg.DLQStream)
	if len(letters) != 2 {
		t.Fatalf("DLQ holds %d messages, want 2", len(letters))
	}
	want := []struct {
		reason string
		data   []byte
		index  int
	}{{stream.ReasonInvalid, bad, 2}, {stream.ReasonMaxDeliver, parts[4], 4}}
	for i, w := range want {
		m := letters[i]
		if m.Subject != events.DLQSubject(cfg.SubjectPrefix, w.reason) || !bytes.Equal(m.Data, w.data) ||
			m.Header.Get("Content-Type") != events.ContentType || m.Header.Get(stream.HeaderContentEncoding) != "" ||
			m.Header.Get(stream.HeaderBatchIndex) != strconv.Itoa(w.index) ||
			m.Header.Get(stream.HeaderMsgID) != "raw-batch" || m.Header.Get(stream.HeaderSequence) != "1" {
			t.Errorf("dead letter %d = %s %q %v", i, m.Subject, m.Data, m.Header)
		}
	}

	// Replayed, the poison event comes back alone, as a single event.
	h.Actual = func(_ context.Context, ev events.Event, _ events.Actual) error { handled[ev.ID]++; return nil }
	if n, err := stream.Replay(ctx, js, cfg, stream.ReasonMaxDeliver); err != nil || n != 1 {
		t.Fatalf("Replay = %d, %v; want 1", n, err)
	}
	msg := fetchOne(t, cons, 5*time.Second)
	if msg == nil || events.IsBatch(msg.Headers().Get("Content-Type")) || msg.Headers().Get(stream.HeaderBatchIndex) != "" {
		t.Fatalf("replayed message = %v", msg)
	}
	if err := stream.Process(ctx, js, cfg, msg, h.Dispatch); err != nil || handled[poison] != cfg.MaxDeliver+1 {
		t.Errorf("replayed poison event: Process = %v, handled %d times", err, handled[poison])
	}
}

// A batch that is not one as a whole is dead-lettered whole, once, as it
// came: malformed JSON, and payloads that do not decompress as their
// Content-Encoding says (an unknown encoding, corrupt S2, S2 that would
// decompress past a batch's 1 MiB).
func TestMalformedBatchDeadLetteredWhole(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	bomb := s2.Encode(nil, make([]byte, events.MaxBatchSize+1))
	malformed := []struct {
		data []byte
		enc  string
	}{
		{[]byte(`{"not":"an array"}`), ""},
		{[]byte(`[`), ""},
		{[]byte(`[]`), ""},
		{s2.Encode(nil, []byte(`[]`)), stream.EncodingS2},
		{[]byte(`[{"specversion":"1.0"}]`), "gzip"},
		{[]byte(`[{"specversion":"1.0"}]`), stream.EncodingS2},
		{bomb, stream.EncodingS2},
		// A block that claims 1 TiB: decompressing must not trust the claim.
		{binary.AppendUvarint(nil, 1<<40), stream.EncodingS2},
	}
	for i, m := range malformed {
		publishRaw(t, js, cfg, m.data, events.BatchContentType, m.enc, "m-"+strconv.Itoa(i))
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	for range malformed {
		msg := fetchOne(t, cons, 5*time.Second)
		if msg == nil {
			t.Fatal("message missing")
		}
		err := stream.Process(ctx, js, cfg, msg, func(context.Context, events.Event) error {
			t.Error("handler called for a malformed batch")
			return nil
		})
		if !errors.Is(err, stream.ErrDeadLettered) || !errors.Is(err, events.ErrInvalid) {
			t.Errorf("Process(malformed batch) = %v, want dead-lettered invalid", err)
		}
	}
	letters := storedMsgs(t, js, cfg.DLQStream)
	if len(letters) != len(malformed) {
		t.Fatalf("DLQ holds %d, want %d", len(letters), len(malformed))
	}
	for i, m := range letters {
		if m.Header.Get("Content-Type") != events.BatchContentType || m.Header.Get(stream.HeaderBatchIndex) != "" ||
			!bytes.Equal(m.Data, malformed[i].data) || m.Header.Get(stream.HeaderContentEncoding) != malformed[i].enc {
			t.Errorf("dead letter of malformed batch %d = %.80q %v, want it whole, as it came", i, m.Data, m.Header)
		}
	}
}

// A batch of a Publisher made WithOwnTime judges each event by its own
// time: an event held for an hour is valid; its dead letter, should it get
// one, carries that time.
func TestBatchOwnTime(t *testing.T) {
	js, cfg := realNATS(t) // MaxAge 10 minutes
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	evs := actuals(3, "own")
	evs[1].Time = time.Now().Add(-time.Hour).UTC() // held by an outbox for an hour
	if err := stream.NewPublisher(js, cfg, stream.WithOwnTime()).PublishBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	old := actuals(1, "old")[0]
	old.Time = evs[1].Time
	old.ID = "old-one"
	// The same old event from a publisher that did not hold it: invalid.
	if err := stream.NewPublisher(js, cfg).PublishBatch(ctx, []events.Event{old, actuals(1, "fresh")[0]}); err != nil {
		t.Fatal(err)
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	var handled []string
	h := func(_ context.Context, ev events.Event) error { handled = append(handled, ev.ID); return nil }
	for range 2 {
		msg := fetchOne(t, cons, 5*time.Second)
		if msg == nil {
			t.Fatal("message missing")
		}
		_ = stream.Process(ctx, js, cfg, msg, h)
	}
	if len(handled) != 4 {
		t.Errorf("handled %d events, want 4 (all but the old one not held by its publisher)", len(handled))
	}
	letters := storedMsgs(t, js, cfg.DLQStream)
	if len(letters) != 1 {
		t.Fatalf("DLQ holds %d, want 1", len(letters))
	}
	ev, err := events.Decode(letters[0].Data)
	if err != nil || ev.ID != "old-one" || letters[0].Header.Get(stream.HeaderFirstStored) == "" {
		t.Errorf("dead letter = %v %v, want old-one with its first storage", ev.ID, letters[0].Header)
	}
}
