package stream_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/klauspost/compress/s2"
	"github.com/nats-io/nats.go"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// Whatever a message of the usage stream carries (anyone who may publish on
// it can send it), Payload returns at most a batch's bytes or an invalid
// error, never panics, and gives back what S2 compressed.
func FuzzPayload(f *testing.F) {
	batch := []byte(`[{"specversion":"1.0","id":"e1","source":"s","type":"quotaflow.usage.actual"}]`)
	f.Add("", batch)
	f.Add("identity", batch)
	f.Add(stream.EncodingS2, s2.Encode(nil, batch))
	f.Add(stream.EncodingS2, s2.Encode(nil, bytes.Repeat(batch, 100)))
	f.Add(stream.EncodingS2, batch) // not S2
	f.Add(stream.EncodingS2, []byte{})
	f.Add(stream.EncodingS2, binary.AppendUvarint(nil, events.MaxBatchSize+1))  // claims more than a batch may hold
	f.Add(stream.EncodingS2, append(binary.AppendUvarint(nil, 64), 0xfc, 0xff)) // a copy past what was written
	f.Add("gzip", batch)
	f.Add("S2", s2.Encode(nil, batch))
	f.Fuzz(func(t *testing.T, enc string, data []byte) {
		h := nats.Header{}
		if enc != "" {
			h.Set(stream.HeaderContentEncoding, enc)
		}
		out, err := stream.Payload(h, data)
		if err != nil {
			if !errors.Is(err, events.ErrInvalid) || out != nil {
				t.Fatalf("Payload(%q, %q) = %q, %v: want nil and an invalid error", enc, data, out, err)
			}
			return
		}
		if len(out) > events.MaxBatchSize {
			t.Fatalf("Payload(%q, ...) = %d bytes, more than a batch's %d", enc, len(out), events.MaxBatchSize)
		}
		switch h.Get(stream.HeaderContentEncoding) {
		case "", "identity":
			if !bytes.Equal(out, data) {
				t.Fatalf("Payload(%q, %q) = %q: want the data as it is", enc, data, out)
			}
		case stream.EncodingS2:
			if again, err := s2.Decode(nil, data); err != nil || !bytes.Equal(again, out) {
				t.Fatalf("Payload(s2, %q) = %q; s2.Decode = %q, %v", data, out, again, err)
			}
		default:
			t.Fatalf("Payload(%q, ...) accepted an unknown encoding", enc)
		}
	})
}
