package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// call is one ShouldRateLimit request of a differential sequence, written
// as "DOMAIN [hN] DESCRIPTOR..." where a descriptor is k=v,k=v entries,
// an optional @N/unit, its own limit (envoy's per-request override), and
// an optional #N, its own hits_addend, and hN is the request's
// hits_addend: "rl h2 foo=x,bar=y category=account#0 foo=y@5/minute".
type call struct {
	text   string
	domain string
	hits   uint32
	descs  []descriptor
}

type descriptor struct {
	entries [][2]string // key, value
	hits    *uint64     // its own hits_addend; nil: the request's
	limit   *rlcommon.RateLimitDescriptor_RateLimitOverride
}

func parseCall(text string) (call, error) {
	f := strings.Fields(text)
	if len(f) == 0 {
		return call{}, fmt.Errorf("empty call")
	}
	c := call{text: text, domain: f[0]}
	if f[0] == `""` {
		c.domain = ""
	}
	for _, tok := range f[1:] {
		if n, ok := strings.CutPrefix(tok, "h"); ok && !strings.Contains(tok, "=") {
			h, err := strconv.ParseUint(n, 10, 32)
			if err != nil {
				return call{}, fmt.Errorf("%q: %w", tok, err)
			}
			c.hits = uint32(h)
			continue
		}
		var d descriptor
		ents, own, found := strings.Cut(tok, "#")
		if found {
			h, err := strconv.ParseUint(own, 10, 64)
			if err != nil {
				return call{}, fmt.Errorf("%q: %w", tok, err)
			}
			d.hits = &h
		}
		ents, lim, found := strings.Cut(ents, "@")
		if found {
			n, unit, _ := strings.Cut(lim, "/")
			rpu, err := strconv.ParseUint(n, 10, 32)
			u, ok := typev3.RateLimitUnit_value[strings.ToUpper(unit)]
			if err != nil || !ok {
				return call{}, fmt.Errorf("%q: limit %q is not N/unit", tok, lim)
			}
			d.limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: uint32(rpu), Unit: typev3.RateLimitUnit(u)}
		}
		for _, kv := range strings.Split(ents, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return call{}, fmt.Errorf("%q: entry %q is not key=value", text, kv)
			}
			d.entries = append(d.entries, [2]string{k, v})
		}
		c.descs = append(c.descs, d)
	}
	return c, nil
}

// request is the call as the wire carries it.
func (c call) request() *rlpb.RateLimitRequest {
	r := &rlpb.RateLimitRequest{Domain: c.domain, HitsAddend: c.hits}
	for _, d := range c.descs {
		pd := &rlcommon.RateLimitDescriptor{}
		for _, e := range d.entries {
			pd.Entries = append(pd.Entries, &rlcommon.RateLimitDescriptor_Entry{Key: e[0], Value: e[1]})
		}
		if d.hits != nil {
			pd.HitsAddend = wrapperspb.UInt64(*d.hits)
		}
		pd.Limit = d.limit
		r.Descriptors = append(r.Descriptors, pd)
	}
	return r
}

// overrides reports whether a descriptor of c carries its own limit, which
// admission refuses (README.md, "Envoy (RLS)": not supported).
func (c call) overrides() bool {
	for _, d := range c.descs {
		if d.limit != nil {
			return true
		}
	}
	return false
}

// cost is what the descriptor adds to its counter: its own hits_addend
// (0 allowed), else the request's, at least 1.
func (c call) cost(i int) uint64 {
	if h := c.descs[i].hits; h != nil {
		return *h
	}
	return uint64(max(1, c.hits))
}

// key names the descriptor's counter as envoy's cache key does (the
// domain and every entry; the window is the sequence's one window).
func (c call) key(i int) string {
	var b strings.Builder
	b.WriteString(c.domain)
	for _, e := range c.descs[i].entries {
		b.WriteString("\x00" + e[0] + "\x00" + e[1])
	}
	return b.String()
}

// model predicts, call by call, what envoyproxy/ratelimit and admission
// answer within one window. Which limit a descriptor matched (config
// lookup, wildcards, replaces, unlimited) it takes from the peer's own
// answer: that is the configuration half, which both must agree on and
// which the comparison of current_limit checks. What it predicts is the
// counting half: the counters each keeps, codes and remaining counts.
//
// envoy counts every descriptor that has a limit, by its cache key, with
// INCRBY in request order, whether or not it is over (a denied hit still
// counts); a descriptor is over when its counter after the increment
// passes the limit; shadow_mode turns its OVER_LIMIT into OK with 0
// remaining (the model learns which limits are in shadow mode from the
// first such answer: its own counters say over, the peer says OK).
//
// admission differs only where README.md ("Envoy (RLS)") says so: a
// request is one all-or-nothing decision, and a denied hit counts nothing.
// A descriptor is over when its counter plus its hits (and those of the
// same descriptor earlier in the request) passes its limit; when one not in
// shadow mode is over, nothing is counted and the others report what they
// had left before the request; else every descriptor with a limit is
// counted, in order, as envoy does.
type model struct {
	envoy, qf map[string]uint64
	shadow    map[string]bool
}

func newModel() *model {
	return &model{envoy: map[string]uint64{}, qf: map[string]uint64{}, shadow: map[string]bool{}}
}

// answerOf starts an answer to c from the peer's limits: every status OK,
// with the peer's current_limit (nil when none applies: no match, replaced,
// unlimited) and nothing remaining yet, or, for an unlimited descriptor
// (no limit, remaining MaxUint32 in the peer's answer), MaxUint32.
func answerOf(c call, peer *rlpb.RateLimitResponse) *rlpb.RateLimitResponse {
	out := &rlpb.RateLimitResponse{OverallCode: rlpb.RateLimitResponse_OK}
	for i := range c.descs {
		pst := peer.GetStatuses()[i]
		st := &rlpb.RateLimitResponse_DescriptorStatus{Code: rlpb.RateLimitResponse_OK, CurrentLimit: pst.GetCurrentLimit()}
		if st.CurrentLimit == nil && pst.GetLimitRemaining() == math.MaxUint32 {
			st.LimitRemaining = math.MaxUint32
		}
		out.Statuses = append(out.Statuses, st)
	}
	return out
}

// over marks st over its limit: OVER_LIMIT unless in shadow mode, and so
// the whole answer.
func (m *model) over(out *rlpb.RateLimitResponse, st *rlpb.RateLimitResponse_DescriptorStatus, key string) {
	if !m.shadow[key] {
		st.Code = rlpb.RateLimitResponse_OVER_LIMIT
		out.OverallCode = rlpb.RateLimitResponse_OVER_LIMIT
	}
}

// envoyAnswer predicts the peer's answer to c, given the peer's actual
// answer for the limits, and counts c.
func (m *model) envoyAnswer(c call, peer *rlpb.RateLimitResponse) *rlpb.RateLimitResponse {
	out := answerOf(c, peer)
	for i, st := range out.Statuses {
		lim := st.GetCurrentLimit()
		if lim == nil {
			continue
		}
		k := c.key(i)
		m.envoy[k] += c.cost(i)
		if after := m.envoy[k]; after <= uint64(lim.RequestsPerUnit) {
			st.LimitRemaining = lim.RequestsPerUnit - uint32(after)
			continue
		}
		if peer.GetStatuses()[i].GetCode() == rlpb.RateLimitResponse_OK {
			m.shadow[k] = true
		}
		m.over(out, st, k)
	}
	return out
}

// qfAnswer predicts admission's answer to c, given the peer's answer for
// the limits (after envoyAnswer has seen it), and counts c.
func (m *model) qfAnswer(c call, peer *rlpb.RateLimitResponse) *rlpb.RateLimitResponse {
	out := answerOf(c, peer)
	over := make([]bool, len(c.descs))
	pending := map[string]uint64{} // a descriptor repeated in the request sees its earlier hits, as in envoy
	for i, st := range out.Statuses {
		lim := st.GetCurrentLimit()
		if lim == nil {
			continue
		}
		k := c.key(i)
		pending[k] += c.cost(i)
		if m.qf[k]+pending[k] > uint64(lim.RequestsPerUnit) {
			over[i] = true
			m.over(out, st, k)
		}
	}
	allowed := out.OverallCode == rlpb.RateLimitResponse_OK
	for i, st := range out.Statuses {
		lim := st.GetCurrentLimit()
		if lim == nil {
			continue
		}
		k := c.key(i)
		if allowed {
			m.qf[k] += c.cost(i)
		}
		if !over[i] {
			st.LimitRemaining = lim.RequestsPerUnit - uint32(min(m.qf[k], uint64(lim.RequestsPerUnit)))
		}
	}
	return out
}

// headers are the RateLimit-Limit, -Remaining and -Reset values an answer
// asks Envoy to add (LIMIT_RESPONSE_HEADERS_ENABLED, QF_ENVOY_RATELIMIT_HEADERS).
type headers struct {
	limit, remaining string
	reset            time.Duration
}

// wantHeaders are the headers envoy derives from an answer's statuses: those
// of the last descriptor over its limit, else of the first with the fewest
// remaining among those with a limit; none when no descriptor has one.
func wantHeaders(r *rlpb.RateLimitResponse) (headers, bool) {
	var pick *rlpb.RateLimitResponse_DescriptorStatus
	least := uint32(math.MaxUint32)
	for _, st := range r.GetStatuses() {
		if st.GetCurrentLimit() != nil && st.GetLimitRemaining() < least {
			pick, least = st, st.GetLimitRemaining()
		}
		if st.GetCode() == rlpb.RateLimitResponse_OVER_LIMIT {
			pick, least = st, 0
		}
	}
	if pick == nil {
		return headers{}, false
	}
	return headers{strconv.FormatUint(uint64(pick.GetCurrentLimit().GetRequestsPerUnit()), 10),
		strconv.FormatUint(uint64(pick.GetLimitRemaining()), 10), pick.GetDurationUntilReset().AsDuration()}, true
}

// gotHeaders reads the headers an answer carries.
func gotHeaders(r *rlpb.RateLimitResponse) (headers, bool) {
	var h headers
	n := 0
	for _, hv := range r.GetResponseHeadersToAdd() {
		switch strings.ToLower(hv.GetKey()) {
		case "ratelimit-limit":
			h.limit = hv.GetValue()
		case "ratelimit-remaining":
			h.remaining = hv.GetValue()
		case "ratelimit-reset":
			s, _ := strconv.Atoi(hv.GetValue())
			h.reset = time.Duration(s) * time.Second
		default:
			continue
		}
		n++
	}
	return h, n == 3
}
