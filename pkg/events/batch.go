package events

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"
)

// BatchContentType is the Content-Type header of a message that carries a
// batch: a JSON array of events in the structured form, the CloudEvents
// JSON batch mode.
const BatchContentType = "application/cloudevents-batch+json"

// Limits of a batch. DecodeBatch rejects anything beyond them and
// EncodeBatch refuses to produce it.
const (
	// MaxBatchEvents is the most events in one batch: enough to amortise a
	// message's cost (a batch of 1024 reserved events is about 700 KiB),
	// few enough that a consumer's transaction stays bounded.
	MaxBatchEvents = 1024
	// MaxBatchSize is the largest encoded batch, in bytes: nats-server's
	// default max_payload (1 MiB), which the usage stream's max message
	// size leaves room for.
	MaxBatchSize = 1 << 20
)

// batchIDPrefix starts every batch id. Event ids are printable ASCII
// without spaces, so an id holding a space is never an event's.
const batchIDPrefix = "batch "

// BatchID returns the Nats-Msg-Id of a batch of events with these ids, in
// order: "batch " and HashID of the ids, so the same batch published again
// is stored once, and a batch never shares an id with an event.
func BatchID(ids []string) string { return batchIDPrefix + HashID(ids...) }

// EncodeBatch validates and encodes evs (as Encode does each) into one
// batch, a JSON array in their order. An invalid event fails the whole
// batch: the error names its index and wraps ErrInvalid. To pack events
// into batches under a size, encode each with Encode and join them with
// AppendBatch.
func EncodeBatch(evs []Event) ([]byte, error) {
	if len(evs) == 0 || len(evs) > MaxBatchEvents {
		return nil, fmt.Errorf("%w: batch: %d events, want 1 to %d", ErrInvalid, len(evs), MaxBatchEvents)
	}
	encoded := make([][]byte, len(evs))
	size := 0
	for i, ev := range evs {
		b, err := Encode(ev)
		if err != nil {
			return nil, fmt.Errorf("batch[%d]: %w", i, err)
		}
		encoded[i] = b
		size += len(b)
	}
	b := AppendBatch(make([]byte, 0, BatchSize(len(evs), size)), encoded)
	if len(b) > MaxBatchSize {
		return nil, fmt.Errorf("%w: batch: %d bytes, larger than %d", ErrInvalid, len(b), MaxBatchSize)
	}
	return b, nil
}

// AppendBatch appends to dst the batch of the encoded events evs (each a
// result of Encode): '[', the events separated by ',', ']'. Its length is
// the sum of theirs plus len(evs)+1.
func AppendBatch(dst []byte, evs [][]byte) []byte {
	dst = append(dst, '[')
	for i, e := range evs {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = append(dst, e...)
	}
	return append(dst, ']')
}

// BatchSize is the length of the batch of encoded events of these sizes
// (AppendBatch's output), for packing.
func BatchSize(n, size int) int { return size + max(n, 1) + 1 }

// DecodeBatch parses a batch: a JSON array of events in the structured
// form. A batch that is not one as a whole (over MaxBatchSize, invalid
// UTF-8 or JSON, not an array, empty, more than MaxBatchEvents elements)
// is one error, wrapping ErrInvalid. Otherwise each element is decoded
// alone, as Decode does: evs[i] is element i when errs[i] is nil, and a
// bad element fails only itself. raw[i] is element i's bytes, for a dead
// letter of that one event.
func DecodeBatch(b []byte) (evs []Event, errs []error, raw [][]byte, err error) {
	return Decoder{}.DecodeBatch(b)
}

// DecodeBatch is DecodeBatch, reading what d says.
func (d Decoder) DecodeBatch(b []byte) (evs []Event, errs []error, raw [][]byte, err error) {
	return decodeBatch(b, d, false)
}

// DecodeReportedBatch is DecodeBatch with each element decoded as
// DecodeReported does (its id ignored): the body of admission's POST
// /v1/usage, checked as a whole once rather than once more per event.
func DecodeReportedBatch(b []byte) (evs []Event, errs []error, err error) {
	evs, errs, _, err = decodeBatch(b, Decoder{}, true)
	return evs, errs, err
}

func decodeBatch(b []byte, d Decoder, noID bool) (evs []Event, errs []error, raw [][]byte, err error) {
	if len(b) > MaxBatchSize {
		return nil, nil, nil, fmt.Errorf("%w: batch: %d bytes, larger than %d", ErrInvalid, len(b), MaxBatchSize)
	}
	if !utf8.Valid(b) {
		return nil, nil, nil, fmt.Errorf("%w: batch: not valid UTF-8", ErrInvalid)
	}
	sp := batchSpans.Get().(*spans)
	defer putSpans(sp)
	if !validate(b, sp) {
		err := json.Unmarshal(b, new(json.RawMessage))
		return nil, nil, nil, fmt.Errorf("%w: batch: not valid JSON: %v", ErrInvalid, err)
	}
	raw, ok := elements(b, sp)
	switch {
	case !ok:
		return nil, nil, nil, fmt.Errorf("%w: batch: not a JSON array", ErrInvalid)
	case len(raw) == 0 || len(raw) > MaxBatchEvents:
		return nil, nil, nil, fmt.Errorf("%w: batch: %d events, want 1 to %d", ErrInvalid, len(raw), MaxBatchEvents)
	}
	evs, errs = make([]Event, len(raw)), make([]error, len(raw))
	var names map[string]string // shared by the batch's events: a lone one has none to share
	if len(raw) > 1 {
		names = map[string]string{}
	}
	for i, e := range raw {
		// An element of valid UTF-8 and JSON is valid UTF-8 and JSON.
		evs[i], errs[i] = decode(e, sp, d, noID, names)
	}
	return evs, errs, raw, nil
}

// batchSpans recycles the spans of batches: a batch of 1024 reserved
// events has about 8,000 containers.
var batchSpans = sync.Pool{New: func() any { return new(spans) }}

// putSpans returns s to batchSpans unless it is huge (a batch of deeply
// nested JSON, which only a broken or hostile publisher sends).
func putSpans(s *spans) {
	if cap(s.open) <= 16*MaxBatchEvents {
		batchSpans.Put(s)
	}
}

// IsBatch reports whether contentType (a message's Content-Type header,
// parameters allowed) is BatchContentType.
func IsBatch(contentType string) bool {
	ct, _, _ := strings.Cut(contentType, ";")
	return strings.TrimSpace(ct) == BatchContentType
}
