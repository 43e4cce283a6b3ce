package stream

import (
	"bytes"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"

	"quotaflow/pkg/events"
)

func TestHeaderValue(t *testing.T) {
	got := headerValue("line one\r\nline two\x00\xff" + strings.Repeat("é", 1000))
	if strings.ContainsAny(got, "\r\n\x00") || len(got) > maxHeaderError || !strings.HasPrefix(got, "line one  line two \uFFFD") {
		t.Errorf("headerValue = %q", got[:40])
	}
	if !strings.HasSuffix(got, "é") {
		t.Errorf("headerValue cut a rune: %q", got[len(got)-4:])
	}
}

// A compressed batch message is the batch, and keeps about its compressed
// size in memory, not the encoder's room for incompressible data (more
// than the batch's JSON): the async publisher holds each message until it
// is acknowledged.
func TestCompressedBatchKeepsItsSize(t *testing.T) {
	const n = 500
	evs, idx, data := make([]events.Event, n), make([]int, n), make([][]byte, n)
	for i := range evs {
		evs[i] = events.NewActual("svc", events.Actual{
			RequestID: fmt.Sprintf("r-%d", i), Tenant: "acme", User: "u-1", InputTokens: int64(i), OutputTokens: 1,
		}, time.Now().UTC())
		b, err := events.Encode(evs[i])
		if err != nil {
			t.Fatal(err)
		}
		idx[i], data[i] = i, b
	}
	p := &Publisher{prefix: "quotaflow"}
	batch := events.AppendBatch(nil, data)
	joined := len(batch)
	live := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	const held = 20
	before := live()
	msgs := make([]*nats.Msg, held)
	for i := range msgs {
		var err error
		if msgs[i], _, err = p.batch(evs, idx, batch); err != nil {
			t.Fatal(err)
		}
	}
	per := int(live()-before) / held
	size := len(msgs[0].Data)
	runtime.KeepAlive(msgs)
	// Compressed in chunks (compressChunk), it is still one S2 block of the batch.
	if got, err := Payload(msgs[0].Header, msgs[0].Data); err != nil || string(got) != string(batch) {
		t.Fatalf("Payload of a batch of %d bytes (%d chunks) = %d bytes, %v; want the batch", joined, (joined+compressChunk-1)/compressChunk, len(got), err)
	}
	if size > joined/4 {
		t.Fatalf("compressed %d bytes into %d, want a quarter at most", joined, size)
	}
	// Beside its data a message holds its ids, headers and batch id: a few KiB.
	if per > size+joined/4 {
		t.Errorf("a batch message of %d bytes (%d uncompressed) keeps %d bytes, want at most %d", size, joined, per, size+joined/4)
	}
}

// pack builds each message's batch in its own buffer, less the closing
// ']', in the events' order by subject; an invalid event and a repeated id
// are left out.
func TestPackBuildsBatchesInPlace(t *testing.T) {
	now := time.Now().UTC()
	act := func(i int) events.Event {
		return events.NewActual("svc", events.Actual{RequestID: fmt.Sprintf("r-%d", i), Tenant: "acme", User: "u-1", InputTokens: 1}, now)
	}
	rel := events.NewReleased("svc", events.Released{RequestID: "r-rel", Tenant: "acme", User: "u-1"}, now)
	bad := act(9)
	bad.ID = ""
	evs := []events.Event{act(0), rel, act(1), bad, act(0), act(2)}
	enc := func(is ...int) []byte {
		var parts [][]byte
		for _, i := range is {
			b, err := events.Encode(evs[i])
			if err != nil {
				t.Fatal(err)
			}
			parts = append(parts, b)
		}
		return events.AppendBatch(nil, parts)
	}
	p := NewPublisher(nil, Config{})
	errs := make([]error, len(evs))
	out, dups := p.pack(evs, errs)
	want := []struct {
		idx   []int
		batch []byte
	}{{[]int{0, 2, 5}, enc(0, 2, 5)}, {[]int{1}, enc(1)}}
	if len(out) != len(want) {
		t.Fatalf("pack made %d messages, want %d", len(out), len(want))
	}
	for k, w := range want {
		got := append(out[k].buf, ']')
		if !slices.Equal(out[k].idx, w.idx) || string(got) != string(w.batch) {
			t.Errorf("message %d: events %v, batch %.60s…; want %v, %.60s…", k, out[k].idx, got, w.idx, w.batch)
		}
	}
	if errs[3] == nil || len(dups) != 1 || dups[4] != 0 {
		t.Errorf("pack: invalid event's error %v, dups %v; want an error and map[4:0]", errs[3], dups)
	}
}

// A round's buffers are kept for the next, whichever goroutine runs it: a
// round allocates its messages' data and its bookkeeping (under its
// batch's size), not its batch and the compression's room again (about 7
// times its size). The bound leaves room for what the package's other
// tests' goroutines allocate meanwhile.
func TestRoundsKeepTheirBuffers(t *testing.T) {
	const n = events.MaxBatchEvents
	evs := make([]events.Event, n)
	for i := range evs { // two types: a message each
		id := fmt.Sprintf("r-%d", i)
		if i%2 == 0 {
			evs[i] = events.NewActual("svc", events.Actual{RequestID: id, Tenant: "acme", User: "u-1", InputTokens: int64(i)}, time.Now().UTC())
		} else {
			evs[i] = events.NewReleased("svc", events.Released{RequestID: id, Tenant: "acme", User: "u-1"}, time.Now().UTC())
		}
	}
	p := NewPublisher(nil, Config{}, WithMaxPayload(2*events.MaxBatchSize)) // one message a type
	size := 0
	round := func() { // on a goroutine of its own, as a round resumed on another processor
		done := make(chan struct{})
		go func() {
			defer close(done)
			out, _ := p.pack(evs, make([]error, n))
			if len(out) != 2 {
				t.Errorf("a round of two types packed %d messages, want 2", len(out))
			}
			size = 0
			for _, g := range out {
				size += len(g.buf)
				p.message(evs, g)
			}
		}()
		<-done
	}
	round()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const rounds = 10
	for range rounds {
		round()
	}
	runtime.ReadMemStats(&after)
	if per := int(after.TotalAlloc-before.TotalAlloc) / rounds; per > 2*size {
		t.Errorf("a round of a %d-byte batch allocated %d bytes, want at most %d", size, per, 2*size)
	}
}

// TestMessagesOwnTheirData: a message's data, as handed to NATS (which may
// send it again until it is acknowledged), shares no buffer the Publisher
// keeps for later rounds: none of it lies in a kept buffer, and once later
// rounds are built in those buffers (the batch first, then the single
// event first, so each buffer serves each kind) each message of the first
// round holds the bytes it was built with. A batch and a single event,
// plain and compressed.
func TestMessagesOwnTheirData(t *testing.T) {
	round := func(user string, singleFirst bool) []events.Event {
		var evs []events.Event
		for i := range 4 { // a batch
			evs = append(evs, events.NewActual("svc", events.Actual{RequestID: fmt.Sprint(user, i), Tenant: "acme", User: user, InputTokens: int64(i)}, time.Now().UTC()))
		}
		single := events.NewReleased("svc", events.Released{RequestID: user, Tenant: "acme", User: user}, time.Now().UTC())
		if singleFirst {
			return append([]events.Event{single}, evs...)
		}
		return append(evs, single)
	}
	for _, compressed := range []bool{false, true} {
		t.Run(fmt.Sprint("compressed=", compressed), func(t *testing.T) {
			p := NewPublisher(nil, Config{}, WithCompression(compressed))
			build := func(evs []events.Event) []*nats.Msg {
				t.Helper()
				out, _ := p.pack(evs, make([]error, len(evs)))
				msgs := make([]*nats.Msg, len(out))
				for i, g := range out {
					m, _, err := p.message(evs, g)
					if err != nil {
						t.Fatal(err)
					}
					msgs[i] = m
				}
				return msgs
			}
			first := build(round("one", false))
			if len(first) != 2 {
				t.Fatalf("a round of a batch and a single event built %d messages, want 2", len(first))
			}
			want := make([][]byte, len(first))
			for i, m := range first {
				want[i] = bytes.Clone(m.Data)
				for _, k := range slices.Concat(p.encoded.bufs, p.compressed.bufs) {
					if overlaps(m.Data, k) {
						t.Errorf("message %d's data lies in a buffer the Publisher keeps", i)
					}
				}
			}
			for _, singleFirst := range []bool{true, false} {
				build(round("two", singleFirst))
				for i, m := range first {
					if !bytes.Equal(m.Data, want[i]) {
						t.Errorf("message %d of the first round changed when a later one was built:\n got %q\nwant %q", i, m.Data, want[i])
					}
				}
			}
		})
	}
}

// overlaps reports whether a and b share memory, as far as their
// capacities reach.
func overlaps(a, b []byte) bool {
	if cap(a) == 0 || cap(b) == 0 {
		return false
	}
	pa, pb := uintptr(unsafe.Pointer(unsafe.SliceData(a))), uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return pa < pb+uintptr(cap(b)) && pb < pa+uintptr(cap(a))
}
