package stream

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

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

// A compressed batch message keeps about its compressed size in memory,
// not the encoder's room for incompressible data (more than the batch's
// JSON): the async publisher holds each message until it is acknowledged.
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
		runtime.GC() // the second empties the encoder's pool: only the messages stay
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	const held = 20
	before := live()
	msgs := make([]*nats.Msg, held)
	for i := range msgs {
		msgs[i], _ = p.batch(evs, idx, batch)
	}
	per := int(live()-before) / held
	size := len(msgs[0].Data)
	runtime.KeepAlive(msgs)
	if size > joined/4 {
		t.Fatalf("compressed %d bytes into %d, want a quarter at most", joined, size)
	}
	// Beside its data a message holds its ids, headers and batch id: a few KiB.
	if per > size+joined/4 {
		t.Errorf("a batch message of %d bytes (%d uncompressed) keeps %d bytes, want at most %d", size, joined, per, size+joined/4)
	}
}
