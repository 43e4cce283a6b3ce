package rls

import (
	"bytes"
	"math"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// encodable are responses EncodeResponse writes itself: the handler's
// answers and the edges of their fields.
func encodable() map[string]*rlspb.RateLimitResponse {
	limit := &rlspb.RateLimitResponse_RateLimit{Name: "per-user", RequestsPerUnit: 100, Unit: rlspb.RateLimitResponse_RateLimit_MINUTE}
	return map[string]*rlspb.RateLimitResponse{
		"empty":   {},
		"unknown": {OverallCode: rlspb.RateLimitResponse_UNKNOWN, Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{{}}},
		"ok": {OverallCode: rlspb.RateLimitResponse_OK, Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{
			{Code: rlspb.RateLimitResponse_OK, CurrentLimit: limit, LimitRemaining: 99, DurationUntilReset: durationpb.New(42e9)},
			{Code: rlspb.RateLimitResponse_OK, LimitRemaining: math.MaxUint32},
			{Code: rlspb.RateLimitResponse_OK},
		}},
		"over, headers": {OverallCode: rlspb.RateLimitResponse_OVER_LIMIT, Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{
			{Code: rlspb.RateLimitResponse_OVER_LIMIT, CurrentLimit: &rlspb.RateLimitResponse_RateLimit{}, DurationUntilReset: &durationpb.Duration{}},
		}, ResponseHeadersToAdd: []*corev3.HeaderValue{{Key: "RateLimit-Limit", Value: "100"}, {}, {RawValue: []byte{0xff}}}},
		"negative": {OverallCode: -1, Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{
			{Code: -2, CurrentLimit: &rlspb.RateLimitResponse_RateLimit{Unit: math.MinInt32, Name: "ключ"},
				DurationUntilReset: &durationpb.Duration{Seconds: math.MinInt64, Nanos: -1}},
		}},
		"large": {Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{
			{CurrentLimit: &rlspb.RateLimitResponse_RateLimit{RequestsPerUnit: math.MaxUint32, Unit: math.MaxInt32, Name: string(bytes.Repeat([]byte("n"), 300))},
				DurationUntilReset: &durationpb.Duration{Seconds: math.MaxInt64, Nanos: math.MaxInt32}},
		}},
	}
}

// EncodeResponse writes the handler's answers byte for byte as protobuf
// does, and leaves the rest to protobuf.
func TestEncodeResponse(t *testing.T) {
	h := &Handler{}
	for name, m := range encodable() {
		want, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := h.EncodeResponse(m)
		if !ok || !bytes.Equal(got, want) {
			t.Errorf("%s: EncodeResponse = %x, %v; want %x, true", name, got, ok, want)
		}
		if ok && len(got) != cap(got) {
			t.Errorf("%s: EncodeResponse's buffer holds %d of %d bytes, want it sized exactly", name, len(got), cap(got))
		}
	}
	withUnknown := func(m proto.Message) proto.Message {
		m.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 1))
		return m
	}
	status := func(s *rlspb.RateLimitResponse_DescriptorStatus) *rlspb.RateLimitResponse {
		return &rlspb.RateLimitResponse{Statuses: []*rlspb.RateLimitResponse_DescriptorStatus{s}}
	}
	for name, m := range map[string]any{
		"request headers":     &rlspb.RateLimitResponse{RequestHeadersToAdd: []*corev3.HeaderValue{{Key: "k"}}},
		"raw body":            &rlspb.RateLimitResponse{RawBody: []byte("x")},
		"quota":               &rlspb.RateLimitResponse{Quota: &rlspb.RateLimitResponse_Quota{}},
		"status quota":        status(&rlspb.RateLimitResponse_DescriptorStatus{Quota: &rlspb.RateLimitResponse_Quota{}}),
		"unit multiplier":     status(&rlspb.RateLimitResponse_DescriptorStatus{CurrentLimit: &rlspb.RateLimitResponse_RateLimit{UnitMultiplier: wrapperspb.UInt32(2)}}),
		"nil status":          status(nil),
		"nil header":          &rlspb.RateLimitResponse{ResponseHeadersToAdd: []*corev3.HeaderValue{nil}},
		"name not UTF-8":      status(&rlspb.RateLimitResponse_DescriptorStatus{CurrentLimit: &rlspb.RateLimitResponse_RateLimit{Name: "a\xff"}}),
		"header not UTF-8":    &rlspb.RateLimitResponse{ResponseHeadersToAdd: []*corev3.HeaderValue{{Value: "\xfe"}}},
		"unknown in response": withUnknown(&rlspb.RateLimitResponse{}),
		"unknown in status":   status(withUnknown(&rlspb.RateLimitResponse_DescriptorStatus{}).(*rlspb.RateLimitResponse_DescriptorStatus)),
		"unknown in limit": status(&rlspb.RateLimitResponse_DescriptorStatus{
			CurrentLimit: withUnknown(&rlspb.RateLimitResponse_RateLimit{}).(*rlspb.RateLimitResponse_RateLimit)}),
		"unknown in reset": status(&rlspb.RateLimitResponse_DescriptorStatus{
			DurationUntilReset: withUnknown(&durationpb.Duration{}).(*durationpb.Duration)}),
		"unknown in header": &rlspb.RateLimitResponse{ResponseHeadersToAdd: []*corev3.HeaderValue{withUnknown(&corev3.HeaderValue{}).(*corev3.HeaderValue)}},
		"nil response":      (*rlspb.RateLimitResponse)(nil),
		"another message":   &rlspb.RateLimitRequest{Domain: "d"},
	} {
		if b, ok := h.EncodeResponse(m); ok {
			t.Errorf("%s: EncodeResponse = %x, true; want false", name, b)
		}
	}
}

// Whatever response protobuf can read from the bytes, EncodeResponse
// either writes it as proto.Marshal does or leaves it to protobuf. Seeds:
// the encodable responses.
func FuzzEncodeResponse(f *testing.F) {
	addMarshalled(f, encodable())
	h := &Handler{}
	f.Fuzz(func(t *testing.T, b []byte) {
		m := &rlspb.RateLimitResponse{}
		if proto.Unmarshal(b, m) != nil {
			return
		}
		got, ok := h.EncodeResponse(m)
		want, err := proto.Marshal(m)
		switch {
		case !ok:
			return
		case err != nil:
			t.Fatalf("EncodeResponse(%v) = %x, true, where proto.Marshal fails: %v", m, got, err)
		case !bytes.Equal(got, want):
			t.Fatalf("EncodeResponse(%v) = %x, want %x", m, got, want)
		}
	})
}
