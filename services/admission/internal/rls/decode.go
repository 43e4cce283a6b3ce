package rls

import (
	"unicode/utf8"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// DecodeRequest reads msg, a *rlspb.RateLimitRequest, from its wire form b
// as proto.Unmarshal would, in five allocations whatever the descriptors
// (every string is a piece of one copy of b; the descriptors, entries and
// hits_addend values are one array each), where protobuf's reflection
// makes one per message and per string. It reads what Envoy sends: the
// domain, descriptors of entries with hits_addend and is_negative_hits,
// and the request's hits_addend. Anything else (another message, a limit
// override, an unknown field, a repeated message field, text that is not
// UTF-8, a malformed field) it leaves to protobuf, reporting false with
// msg untouched; grpcapi's codec then decodes msg as usual.
func (h *Handler) DecodeRequest(b []byte, msg any) bool {
	req, ok := msg.(*rlspb.RateLimitRequest)
	if !ok {
		return false
	}
	var n counts
	if !n.request(b) {
		return false
	}
	fill(b, req, &n)
	return true
}

// counts are what a request's wire form holds, found by a first pass
// that checks every field fill reads.
type counts struct {
	descriptors, entries, hits int
}

// fields walks the fields of message b, calling f with each field's
// number, wire type and value (a varint's in v, a length-delimited field's
// bytes in s), and reports false at a malformed field, a wire type other
// than these two, or when f reports false.
func fields(b []byte, f func(num protowire.Number, typ protowire.Type, v uint64, s []byte) bool) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		var v uint64
		var s []byte
		switch typ {
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			s, n = protowire.ConsumeBytes(b)
		default:
			return false
		}
		if n < 0 || !f(num, typ, v, s) {
			return false
		}
		b = b[n:]
	}
	return true
}

func (n *counts) request(b []byte) bool {
	return fields(b, func(num protowire.Number, typ protowire.Type, _ uint64, s []byte) bool {
		switch {
		case num == 1 && typ == protowire.BytesType: // domain
			return utf8.Valid(s)
		case num == 2 && typ == protowire.BytesType: // descriptors
			n.descriptors++
			return n.descriptor(s)
		case num == 3 && typ == protowire.VarintType: // hits_addend
			return true
		}
		return false
	})
}

func (n *counts) descriptor(b []byte) bool {
	hits := false
	return fields(b, func(num protowire.Number, typ protowire.Type, _ uint64, s []byte) bool {
		switch {
		case num == 1 && typ == protowire.BytesType: // entries
			n.entries++
			return entry(s)
		case num == 3 && typ == protowire.BytesType && !hits: // hits_addend, once: a second merges
			hits = true
			n.hits++
			return fields(s, func(num protowire.Number, typ protowire.Type, _ uint64, _ []byte) bool {
				return num == 1 && typ == protowire.VarintType
			})
		case num == 4 && typ == protowire.VarintType: // is_negative_hits
			return true
		}
		return false
	})
}

func entry(b []byte) bool {
	return fields(b, func(num protowire.Number, typ protowire.Type, _ uint64, s []byte) bool {
		return (num == 1 || num == 2) && typ == protowire.BytesType && utf8.Valid(s)
	})
}

// fill decodes b, checked by counts.request, into req.
func fill(b []byte, req *rlspb.RateLimitRequest, n *counts) {
	str := string(b) // the one copy every string of the request is part of
	text := func(s []byte) string {
		if len(s) == 0 {
			return ""
		}
		at := cap(b) - cap(s) // s lies within b
		return str[at : at+len(s)]
	}
	ds := make([]rlv3.RateLimitDescriptor, n.descriptors)
	es := make([]rlv3.RateLimitDescriptor_Entry, n.entries)
	var hs []wrapperspb.UInt64Value
	if n.hits > 0 {
		hs = make([]wrapperspb.UInt64Value, n.hits)
	}
	dps := make([]*rlv3.RateLimitDescriptor, 0, n.descriptors)
	eps := make([]*rlv3.RateLimitDescriptor_Entry, 0, n.entries)
	fields(b, func(num protowire.Number, _ protowire.Type, v uint64, s []byte) bool {
		switch num {
		case 1:
			req.Domain = text(s)
		case 3:
			req.HitsAddend = uint32(v)
		case 2:
			d := &ds[len(dps)]
			dps = append(dps, d)
			first := len(eps)
			fields(s, func(num protowire.Number, _ protowire.Type, v uint64, s []byte) bool {
				switch num {
				case 1:
					e := &es[len(eps)]
					eps = append(eps, e)
					fields(s, func(num protowire.Number, _ protowire.Type, _ uint64, s []byte) bool {
						if num == 1 {
							e.Key = text(s)
						} else {
							e.Value = text(s)
						}
						return true
					})
				case 3:
					w := &hs[0]
					hs = hs[1:]
					fields(s, func(_ protowire.Number, _ protowire.Type, v uint64, _ []byte) bool {
						w.Value = v
						return true
					})
					d.HitsAddend = w
				case 4:
					d.IsNegativeHits = v != 0
				}
				return true
			})
			if len(eps) > first {
				d.Entries = eps[first:len(eps):len(eps)]
			}
		}
		return true
	})
	if len(dps) > 0 {
		req.Descriptors = dps
	}
}
