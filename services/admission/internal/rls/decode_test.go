package rls

import (
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/envoypeer"
)

// decodable are requests DecodeRequest reads itself.
func decodable() map[string]*rlspb.RateLimitRequest {
	entry := func(k, v string) *rlv3.RateLimitDescriptor_Entry {
		return &rlv3.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	return map[string]*rlspb.RateLimitRequest{
		"empty":        {},
		"one":          envoypeer.BenchRequest("bench", "u1", 1),
		"five":         envoypeer.BenchRequest("bench", "u1", 5),
		"request hits": {Domain: "d", HitsAddend: 7, Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("k", "v")}}}},
		"descriptor hits": {Domain: "d", Descriptors: []*rlv3.RateLimitDescriptor{
			{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("k", "v")}, HitsAddend: wrapperspb.UInt64(0)},
			{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("k", "w")}, HitsAddend: wrapperspb.UInt64(1 << 40), IsNegativeHits: true},
			{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("k", "x")}},
		}},
		"empty values":  {Domain: "d", Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("", ""), {}}}, {}}},
		"utf-8":         {Domain: "dé", Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{entry("ключ", "值")}}}},
		"no descriptor": {Domain: "d", HitsAddend: 1},
	}
}

// DecodeRequest reads what Envoy sends exactly as protobuf does, and
// leaves the rest, untouched, to protobuf.
func TestDecodeRequest(t *testing.T) {
	h := &Handler{}
	for name, want := range decodable() {
		b, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		got := &rlspb.RateLimitRequest{}
		if !h.DecodeRequest(b, got) {
			t.Errorf("%s: DecodeRequest(%x) = false, want true", name, b)
			continue
		}
		if !proto.Equal(got, want) {
			t.Errorf("%s: DecodeRequest(%x) = %v, want %v", name, b, got, want)
		}
	}

	marshal := func(m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	one := marshal(envoypeer.BenchRequest("bench", "u1", 1))
	override := envoypeer.BenchRequest("bench", "u1", 1)
	override.Descriptors[0].Limit = &rlv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1}
	descriptor := func(fields ...byte) []byte { // a request of one descriptor with these fields
		return protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), fields)
	}
	hits := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), protowire.AppendVarint([]byte{0x08}, 1))
	for name, b := range map[string][]byte{
		"limit override":     marshal(override),
		"unknown field":      protowire.AppendVarint(protowire.AppendTag(one, 9, protowire.VarintType), 1),
		"domain not UTF-8":   protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "a\xffb"),
		"value not UTF-8":    descriptor(protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "\x12\x02\xff\xfe")...),
		"two hits_addend":    descriptor(append(hits, hits...)...),
		"truncated":          one[:len(one)-1],
		"wrong wire type":    protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1),
		"fixed32 field":      protowire.AppendFixed32(protowire.AppendTag(nil, 3, protowire.Fixed32Type), 1),
		"unknown in entry":   descriptor(protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte{0x18, 0x01})...),
		"unknown in wrapper": descriptor(protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), []byte{0x10, 0x01})...),
	} {
		got := &rlspb.RateLimitRequest{}
		if h.DecodeRequest(b, got) {
			t.Errorf("%s: DecodeRequest(%x) = true, want false", name, b)
		}
		if !proto.Equal(got, &rlspb.RateLimitRequest{}) {
			t.Errorf("%s: DecodeRequest(%x) left %v, want the message untouched", name, b, got)
		}
	}
	if h.DecodeRequest(one, &rlv3.RateLimitDescriptor{}) {
		t.Error("DecodeRequest(a descriptor) = true, want false: it reads RateLimitRequest only")
	}
}

// DecodeRequest's allocations do not grow with the descriptors and
// entries: a guard, not a measurement.
func TestDecodeRequestAllocations(t *testing.T) {
	h := &Handler{}
	for _, n := range []int{1, 5} {
		b, err := proto.Marshal(envoypeer.BenchRequest("bench", "u1", n))
		if err != nil {
			t.Fatal(err)
		}
		allocs := testing.AllocsPerRun(100, func() {
			if !h.DecodeRequest(b, &rlspb.RateLimitRequest{}) {
				t.Fatal("DecodeRequest = false")
			}
		})
		// The request itself (which the generated handler allocates),
		// the copy of b, and two arrays each of descriptors and entries.
		if allocs > 6 {
			t.Errorf("%d descriptors: DecodeRequest allocates %v times, want at most 6", n, allocs)
		}
	}
}

// Whatever the bytes, DecodeRequest either decodes them as proto.Unmarshal
// does or leaves them to it. Seeds: the decodable requests, and in
// testdata/fuzz/FuzzDecodeRequest the shapes TestDecodeRequest leaves to
// protobuf, so the fuzzer starts from both sides of the line.
func FuzzDecodeRequest(f *testing.F) {
	addMarshalled(f, decodable())
	h := &Handler{}
	f.Fuzz(func(t *testing.T, b []byte) {
		got := &rlspb.RateLimitRequest{}
		if !h.DecodeRequest(b, got) {
			if !proto.Equal(got, &rlspb.RateLimitRequest{}) {
				t.Fatalf("DecodeRequest(%x) = false, leaving %v", b, got)
			}
			return
		}
		want := &rlspb.RateLimitRequest{}
		if err := proto.Unmarshal(b, want); err != nil {
			t.Fatalf("DecodeRequest(%x) = true, where proto.Unmarshal fails: %v", b, err)
		}
		if !proto.Equal(got, want) {
			t.Fatalf("DecodeRequest(%x) = %v, want %v", b, got, want)
		}
	})
}

// addMarshalled seeds f with the wire form of each of ms.
func addMarshalled[M proto.Message](f *testing.F, ms map[string]M) {
	for _, m := range ms {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}
