package rls

import (
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// EncodeResponse returns the wire form of msg, a *rlspb.RateLimitResponse,
// as proto.Marshal would (fields in number order, zero values left out),
// in one allocation, where protobuf's reflection walks every message
// twice (its size, then its bytes). It writes what the handler answers:
// the overall code, the statuses with their limit and reset, and the
// response headers. Anything else (request headers, a body, metadata, a
// quota, a unit multiplier, unknown fields, a nil status) it leaves to
// protobuf, reporting false; grpcapi's codec then encodes msg as usual.
func (h *Handler) EncodeResponse(msg any) ([]byte, bool) {
	r, ok := msg.(*rlspb.RateLimitResponse)
	if !ok || r == nil {
		return nil, false
	}
	n, ok := responseSize(r)
	if !ok {
		return nil, false
	}
	return appendResponse(make([]byte, 0, n), r), true
}

// unknown reports whether m holds fields its type does not declare.
func unknown(m proto.Message) bool {
	return len(m.ProtoReflect().GetUnknown()) > 0
}

// Sizes, in bytes, of a tag (field numbers up to 15) and a field's value;
// a zero value (0, or an empty string or bytes) is left out, as proto3
// writes it.
func varintField(v uint64) int {
	if v == 0 {
		return 0
	}
	return 1 + protowire.SizeVarint(v)
}

func bytesField(n int) int {
	if n == 0 {
		return 0
	}
	return 1 + protowire.SizeBytes(n)
}

// messageField is the size of a message field: written even when empty.
func messageField(n int) int { return 1 + protowire.SizeBytes(n) }

// enum is an enum's varint, as protobuf writes an int32.
func enum(v int32) uint64 { return uint64(int64(v)) }

func responseSize(r *rlspb.RateLimitResponse) (int, bool) {
	if len(r.RequestHeadersToAdd) > 0 || len(r.RawBody) > 0 || r.DynamicMetadata != nil || r.Quota != nil || unknown(r) {
		return 0, false
	}
	n := varintField(enum(int32(r.OverallCode)))
	for _, s := range r.Statuses {
		m, ok := statusSize(s)
		if !ok {
			return 0, false
		}
		n += messageField(m)
	}
	for _, hv := range r.ResponseHeadersToAdd {
		if hv == nil || unknown(hv) || !validUTF8(hv.Key, hv.Value) {
			return 0, false
		}
		n += messageField(headerSize(hv))
	}
	return n, true
}

func statusSize(s *rlspb.RateLimitResponse_DescriptorStatus) (int, bool) {
	if s == nil || s.Quota != nil || unknown(s) {
		return 0, false
	}
	n := varintField(enum(int32(s.Code)))
	if l := s.CurrentLimit; l != nil {
		if l.UnitMultiplier != nil || unknown(l) || !validUTF8(l.Name) {
			return 0, false
		}
		n += messageField(limitSize(l))
	}
	n += varintField(uint64(s.LimitRemaining))
	if d := s.DurationUntilReset; d != nil {
		if unknown(d) {
			return 0, false
		}
		n += messageField(durationSize(d))
	}
	return n, true
}

func limitSize(l *rlspb.RateLimitResponse_RateLimit) int {
	return varintField(uint64(l.RequestsPerUnit)) + varintField(enum(int32(l.Unit))) + bytesField(len(l.Name))
}

// validUTF8 reports whether strings are UTF-8, as protobuf requires of a
// proto3 string when it writes one.
func validUTF8(ss ...string) bool {
	for _, s := range ss {
		if !utf8.ValidString(s) {
			return false
		}
	}
	return true
}

func durationSize(d *durationpb.Duration) int {
	return varintField(uint64(d.Seconds)) + varintField(uint64(int64(d.Nanos)))
}

func headerSize(hv *corev3.HeaderValue) int {
	return bytesField(len(hv.Key)) + bytesField(len(hv.Value)) + bytesField(len(hv.RawValue))
}

// appendResponse appends r, checked by responseSize.
func appendResponse(b []byte, r *rlspb.RateLimitResponse) []byte {
	b = appendVarint(b, 1, enum(int32(r.OverallCode)))
	for _, s := range r.Statuses {
		n, _ := statusSize(s)
		b = protowire.AppendVarint(protowire.AppendTag(b, 2, protowire.BytesType), uint64(n))
		b = appendStatus(b, s)
	}
	for _, hv := range r.ResponseHeadersToAdd {
		b = protowire.AppendVarint(protowire.AppendTag(b, 3, protowire.BytesType), uint64(headerSize(hv)))
		b = appendString(b, 1, hv.Key)
		b = appendString(b, 2, hv.Value)
		if len(hv.RawValue) > 0 {
			b = protowire.AppendBytes(protowire.AppendTag(b, 3, protowire.BytesType), hv.RawValue)
		}
	}
	return b
}

func appendStatus(b []byte, s *rlspb.RateLimitResponse_DescriptorStatus) []byte {
	b = appendVarint(b, 1, enum(int32(s.Code)))
	if l := s.CurrentLimit; l != nil {
		b = protowire.AppendVarint(protowire.AppendTag(b, 2, protowire.BytesType), uint64(limitSize(l)))
		b = appendVarint(b, 1, uint64(l.RequestsPerUnit))
		b = appendVarint(b, 2, enum(int32(l.Unit)))
		b = appendString(b, 3, l.Name)
	}
	b = appendVarint(b, 3, uint64(s.LimitRemaining))
	if d := s.DurationUntilReset; d != nil {
		b = protowire.AppendVarint(protowire.AppendTag(b, 4, protowire.BytesType), uint64(durationSize(d)))
		b = appendVarint(b, 1, uint64(d.Seconds))
		b = appendVarint(b, 2, uint64(int64(d.Nanos)))
	}
	return b
}

// appendVarint appends a varint field unless v is 0.
func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), v)
}

// appendString appends a string field unless it is empty.
func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	return protowire.AppendString(protowire.AppendTag(b, num, protowire.BytesType), s)
}
