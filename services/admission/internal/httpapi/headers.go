package httpapi

import (
	"hash/maphash"
	"math"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
)

// The rate-limit headers follow draft-ietf-httpapi-ratelimit-headers-11:
//
//	RateLimit-Policy: "user:5h";q=1000;w=18000;qf-unit="tokens", "user:rps";q=10;w=2;qu="requests"
//	RateLimit: "user:5h";r=10;t=1800;qf-unit="tokens"
//
// Both are Structured Field Lists of Items whose value is a String naming the
// policy: "<scope>:<limit name>", or "user:endpoint:<name>" for an
// endpoint's per-user limits (a limit name cannot contain ':', so names
// never collide). RateLimit-Policy lists every limit that applied (shadow
// limits excluded: they never deny); q is the limit, w its window in whole
// seconds (rounded up; a token bucket's w is the time to refill its burst,
// a calendar month, a balance and a concurrency limit have none). The draft's
// quota units registry has "requests", "content-bytes" and
// "concurrent-requests" only, so request limits say qu="requests",
// concurrency limits qu="concurrent-requests", and token limits carry the
// vendor parameter qf-unit="tokens" (the draft asks for vendor-prefixed
// parameters for anything else; a client unaware of it reads the quota as
// abstract units). RateLimit names the most constraining limit, with r its
// remaining quota (never negative) and t the seconds until it frees capacity
// or resets.

// policyName is a limit's name in the RateLimit headers and in a
// problem's violated-policies.
func policyName(l decide.LimitState) string { return string(appendPolicyChars(nil, &l)) }

// appendPolicyName appends policyName(l) as a Structured Field String.
func appendPolicyName(b []byte, l *decide.LimitState) []byte {
	return append(appendPolicyChars(append(b, '"'), l), '"')
}

// appendPolicyChars appends l's policy name, "user:endpoint:<name>" for an
// endpoint's per-user limit and "<scope>:<name>" otherwise, as the
// characters of a Structured Field String.
func appendPolicyChars(b []byte, l *decide.LimitState) []byte {
	if l.Scope == policy.ScopeUser && l.Endpoint != "" {
		b = append(b, "user:endpoint:"...)
	} else {
		b = append(appendSFChars(b, string(l.Scope)), ':')
	}
	return appendSFChars(b, l.Name)
}

// appendSFChars appends s as the characters of a Structured Field String:
// printable ASCII with '"' and '\' escaped; anything else becomes '?',
// which policy names never contain.
func appendSFChars(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20 || c > 0x7e:
			b = append(b, '?')
		default:
			b = append(b, c)
		}
	}
	return b
}

// ceilSeconds rounds d up to whole seconds (0 for d ≤ 0).
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// windowSeconds is the w parameter of a rule, 0 when it has none.
func windowSeconds(r *policy.Rule) int64 {
	if r == nil {
		return 0
	}
	switch r.Kind {
	case policy.Rolling, policy.Fixed, policy.SlidingLog:
		return max(1, ceilSeconds(time.Duration(r.Window)))
	case policy.TokenBucket:
		per := time.Duration(r.Per)
		if r.Rate <= 0 {
			return max(1, ceilSeconds(per))
		}
		refill := float64(per) * float64(r.Burst) / r.Rate
		if refill > float64(math.MaxInt64/2) {
			return 0
		}
		return max(1, ceilSeconds(time.Duration(refill)))
	}
	return 0
}

// ruleOf finds the policy rule behind a limit state (for its window and
// kind); nil when none (res is empty after a decision allowed without
// checking).
func ruleOf(res *policy.Resolved, l decide.LimitState) *policy.Rule {
	var list []policy.Rule
	switch l.Scope {
	case policy.ScopeIP:
		list = res.IP
	case policy.ScopeGlobal:
		list = res.Global
	default:
		list = res.Subject
	}
	for i := range list {
		r := &list[i]
		if r.Scope == l.Scope && r.Name == l.Name && r.Endpoint == l.Endpoint {
			return r
		}
	}
	return nil
}

// unitParam is the unit parameter of a limit's items.
func unitParam(l decide.LimitState, r *policy.Rule) string {
	switch {
	case r != nil && r.Kind == policy.Concurrency:
		return `;qu="concurrent-requests"`
	case l.Unit == policy.Tokens:
		return `;qf-unit="tokens"`
	default:
		return `;qu="requests"`
	}
}

// constraining picks the limit a client will run into first: the one that
// denied, else the one that fits the fewest more requests of this cost
// (remaining / cost for token limits, remaining for request limits), ties
// going to the later reset. Shadow limits never count. It returns -1 when
// no limit applies.
func constraining(res decide.Result, cost int64) int {
	best, bestFit, bestReset := -1, int64(math.MaxInt64), time.Duration(-1)
	for i, l := range res.Limits {
		if l.Shadow {
			continue
		}
		if !res.Allowed && res.DeniedBy != nil && l.Scope == res.DeniedBy.Scope &&
			l.Name == res.DeniedBy.Name && l.Endpoint == res.DeniedBy.Endpoint {
			return i
		}
		fit := max(l.Remaining, 0)
		if l.Unit == policy.Tokens {
			switch {
			case cost > 0:
				fit /= cost
			case fit > 0:
				fit = math.MaxInt64 - 1 // a free request always fits
			}
		}
		if fit < bestFit || fit == bestFit && l.Reset > bestReset {
			best, bestFit, bestReset = i, fit, l.Reset
		}
	}
	return best
}

// The rate-limit header names in canonical form, so that setting them does
// not canonicalize (and allocate) per request.
var (
	hdrPolicy       = http.CanonicalHeaderKey("RateLimit-Policy")
	hdrRateLimit    = http.CanonicalHeaderKey("RateLimit")
	hdrXLimit       = http.CanonicalHeaderKey("X-RateLimit-Limit")
	hdrXRemaining   = http.CanonicalHeaderKey("X-RateLimit-Remaining")
	hdrXReset       = http.CanonicalHeaderKey("X-RateLimit-Reset")
	hdrRetryAfter   = http.CanonicalHeaderKey("Retry-After")
	hdrContentType  = http.CanonicalHeaderKey("Content-Type")
	hdrCacheControl = http.CanonicalHeaderKey("Cache-Control")
	hdrDate         = http.CanonicalHeaderKey("Date")
)

// policyValues holds recent RateLimit-Policy values, each in the slot its
// bytes hash to (the latest one there). The header lists the limits that
// applied with their sizes, windows and units, the policy's but for a
// balance's size, so answers repeat the values of a few plans: one found
// here is shared, not copied into a new string (~60 bytes a limit, a third
// of the bytes a five-limit answer's headers allocated).
var (
	policyValues [64]atomic.Pointer[[]string]
	policySeed   = maphash.MakeSeed()
)

// sharedPolicyValue returns b as a header value: the one policyValues
// holds when it is b, else a new one it holds from now on.
func sharedPolicyValue(b []byte) []string {
	slot := &policyValues[maphash.Bytes(policySeed, b)%uint64(len(policyValues))]
	if v := slot.Load(); v != nil && (*v)[0] == string(b) {
		return *v
	}
	v := []string{string(b)} // full: an Add to the header copies it
	slot.Store(&v)
	return v
}

// setRateLimitHeaders writes RateLimit-Policy, RateLimit and the
// X-RateLimit-* headers for a decision, and Retry-After (with retryAfter
// > 0, i.e. on a denial that waiting cures). RateLimit-Policy is shared
// with earlier answers (sharedPolicyValue) unless a balance's size, the
// user's own, is in it; the other values are cut from one string and the
// headers' value slices from one array: two allocations, not one or two
// per header.
func setRateLimitHeaders(h http.Header, res *decide.Result, cost, retryAfter int64) {
	var arr [512]byte
	b := arr[:0]
	var ends [6]int // where each header's value ends in b
	var keys [6]string
	n := 0
	cut := func(key string) {
		keys[n], ends[n] = key, len(b)
		n++
	}
	shared := true
	for i := range res.Limits {
		l := &res.Limits[i]
		if l.Shadow {
			continue
		}
		r := ruleOf(&res.Rules, *l)
		if r == nil || r.Kind == policy.Balance {
			shared = false
		}
		if len(b) > 0 {
			b = append(b, ", "...)
		}
		b = appendPolicyName(b, l)
		b = strconv.AppendInt(append(b, ";q="...), max(l.Limit, 0), 10)
		if w := windowSeconds(r); w > 0 {
			b = strconv.AppendInt(append(b, ";w="...), w, 10)
		}
		b = append(b, unitParam(*l, r)...)
	}
	switch {
	case len(b) > 0 && shared:
		h[hdrPolicy] = sharedPolicyValue(b)
		b = b[:0]
	case len(b) > 0:
		cut(hdrPolicy)
	}
	if i := constraining(*res, cost); i >= 0 {
		l := &res.Limits[i]
		remaining := max(l.Remaining, 0)
		reset := ceilSeconds(l.Reset)
		if !res.Allowed && res.DeniedBy != nil { // (a reused request id is denied by no limit)
			remaining = 0
			// Retry-After must not point before the end of the effective
			// window (draft §6).
			reset = max(reset, retryAfter)
		}
		b = appendPolicyName(b, l)
		b = strconv.AppendInt(append(b, ";r="...), remaining, 10)
		b = strconv.AppendInt(append(b, ";t="...), reset, 10)
		if l.Unit == policy.Tokens {
			b = append(b, `;qf-unit="tokens"`...)
		}
		cut(hdrRateLimit)
		b = strconv.AppendInt(b, max(l.Limit, 0), 10)
		cut(hdrXLimit)
		b = strconv.AppendInt(b, remaining, 10)
		cut(hdrXRemaining)
		b = strconv.AppendInt(b, reset, 10)
		cut(hdrXReset)
	}
	if retryAfter > 0 {
		b = strconv.AppendInt(b, retryAfter, 10)
		cut(hdrRetryAfter)
	}
	if n == 0 {
		return
	}
	all := string(b)
	vals := make([]string, n)
	start := 0
	for i := range n {
		vals[i] = all[start:ends[i]]
		h[keys[i]] = vals[i : i+1 : i+1] // full: an Add to one header cannot overwrite the next
		start = ends[i]
	}
}

// retryAfterSeconds is the Retry-After of a denial: the wait rounded up
// to whole seconds, at least 1; 0 (no header) when waiting does not help.
func retryAfterSeconds(res decide.Result) int64 {
	if res.Allowed {
		return 0
	}
	if res.RetryAfter <= 0 {
		if res.Reason != limits.ReasonNone {
			return 0
		}
		return 1 // a denial always frees up eventually; never invite a hot loop
	}
	return max(1, ceilSeconds(res.RetryAfter))
}
