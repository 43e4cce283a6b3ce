package stream

import (
	"fmt"

	"github.com/klauspost/compress/s2"
	"github.com/nats-io/nats.go"

	"quotaflow/pkg/events"
)

// HeaderContentEncoding says how a message's payload is compressed: absent
// (or "identity") for the plain JSON of events, EncodingS2 for S2.
const HeaderContentEncoding = "Content-Encoding"

// EncodingS2 is the S2 block format (github.com/klauspost/compress/s2),
// which PublishBatch compresses every batch message with: a batch's events
// repeat their field names and most values, so S2 shrinks it 4-6× at a
// fraction of a µs per event, and nats-server spends about 7 ns per byte
// it stores and delivers besides its cost per message (bench/results.md,
// "NATS per accounted request (session 3)").
const EncodingS2 = "s2"

// Payload returns the events' bytes of a message of the usage stream with
// header h and data: data itself, or data decompressed as h's
// Content-Encoding says. A payload that is not of a known encoding, does
// not decompress, or would decompress to more than events.MaxBatchSize
// bytes is invalid (wrapping events.ErrInvalid): decompressing never
// allocates more than a batch may hold.
func Payload(h nats.Header, data []byte) ([]byte, error) {
	switch enc := h.Get(HeaderContentEncoding); enc {
	case "", "identity":
		return data, nil
	case EncodingS2:
		n, err := s2.DecodedLen(data)
		if err != nil {
			return nil, fmt.Errorf("%w: %s payload: %v", events.ErrInvalid, enc, err)
		}
		if n > events.MaxBatchSize {
			return nil, fmt.Errorf("%w: %s payload: %d bytes decompressed, larger than %d", events.ErrInvalid, enc, n, events.MaxBatchSize)
		}
		out, err := s2.Decode(make([]byte, n), data)
		if err != nil {
			return nil, fmt.Errorf("%w: %s payload: %v", events.ErrInvalid, enc, err)
		}
		return out, nil
	default:
		return nil, fmt.Errorf("%w: content encoding %q: want none or %q", events.ErrInvalid, headerValue(enc), EncodingS2)
	}
}
