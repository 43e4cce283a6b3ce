package httpapi

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The admit and authz answers are written by hand: encoding/json's
// reflection was the largest cost of the HTTP layer. The output is byte for
// byte what json.Marshal makes of a decisionBody (TestDecisionJSON and
// FuzzDecisionJSON hold it to that), so clients see no difference.

// bufPool holds response buffers; an admit answer is under 1 KiB.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// The values of Cache-Control and of a decision's Content-Type, shared
// (net/http only reads header values) and full, so that an Add to a
// header copies them rather than writing into the shared array.
var (
	noStore     = []string{"no-store"}
	jsonType    = []string{"application/json"}
	problemType = []string{"application/problem+json"}
)

// writeDecision writes body as writeJSON would, with contentType (jsonType
// or problemType).
func writeDecision(w http.ResponseWriter, status int, contentType []string, body *decisionBody) {
	bp := bufPool.Get().(*[]byte)
	b := append(body.appendJSON((*bp)[:0]), '\n')
	h := w.Header()
	h[hdrContentType] = contentType
	h[hdrCacheControl] = noStore
	h[hdrDate] = dateOf(time.Now())
	w.WriteHeader(status)
	_, _ = w.Write(b)
	if cap(b) <= 64<<10 { // keep a rare huge answer out of the pool
		*bp = b
		bufPool.Put(bp)
	}
}

// appendJSON appends json.Marshal(b).
func (b *decisionBody) appendJSON(dst []byte) []byte {
	dst = append(dst, '{')
	if b.Type != "" {
		dst = appendString(append(dst, `"type":`...), b.Type)
		dst = append(dst, ',')
	}
	if b.Title != "" {
		dst = appendString(append(dst, `"title":`...), b.Title)
		dst = append(dst, ',')
	}
	if b.Status != 0 {
		dst = strconv.AppendInt(append(dst, `"status":`...), int64(b.Status), 10)
		dst = append(dst, ',')
	}
	if b.Detail != "" {
		dst = appendString(append(dst, `"detail":`...), b.Detail)
		dst = append(dst, ',')
	}
	if len(b.ViolatedPolicies) > 0 {
		dst = append(dst, `"violated-policies":[`...)
		for i, p := range b.ViolatedPolicies {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = appendString(dst, p)
		}
		dst = append(dst, "],"...)
	}
	dst = strconv.AppendBool(append(dst, `"allowed":`...), b.Allowed)
	dst = appendString(append(dst, `,"request_id":`...), b.RequestID)
	if d := b.DeniedBy; d != nil {
		dst = appendString(append(dst, `,"denied_by":{"scope":`...), d.Scope)
		dst = appendString(append(dst, `,"name":`...), d.Name)
		if d.Endpoint != "" {
			dst = appendString(append(dst, `,"endpoint":`...), d.Endpoint)
		}
		dst = append(dst, '}')
	}
	if b.Reason != "" {
		dst = appendString(append(dst, `,"reason":`...), b.Reason)
	}
	if b.RetryAfterSeconds != 0 {
		dst = strconv.AppendInt(append(dst, `,"retry_after_seconds":`...), b.RetryAfterSeconds, 10)
	}
	dst = append(dst, `,"limits":`...)
	if b.Limits == nil {
		return append(dst, "null}"...)
	}
	dst = append(dst, '[')
	for i := range b.Limits {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = b.Limits[i].appendJSON(dst)
	}
	return append(dst, "]}"...)
}

// appendJSON appends json.Marshal(l).
func (l *limitJSON) appendJSON(dst []byte) []byte {
	dst = appendString(append(dst, `{"scope":`...), l.Scope)
	dst = appendString(append(dst, `,"name":`...), l.Name)
	if l.Endpoint != "" {
		dst = appendString(append(dst, `,"endpoint":`...), l.Endpoint)
	}
	dst = appendString(append(dst, `,"unit":`...), l.Unit)
	dst = strconv.AppendInt(append(dst, `,"limit":`...), l.Limit, 10)
	dst = strconv.AppendInt(append(dst, `,"used":`...), l.Used, 10)
	dst = strconv.AppendInt(append(dst, `,"remaining":`...), l.Remaining, 10)
	dst = strconv.AppendInt(append(dst, `,"reset_seconds":`...), l.ResetSeconds, 10)
	if l.Shadow {
		dst = append(dst, `,"shadow":true`...)
	}
	return append(dst, '}')
}

// appendString appends s as encoding/json quotes it. Identifiers are
// printable ASCII almost always; anything else (escapes, HTML-escaped
// characters, non-ASCII, invalid UTF-8) goes through encoding/json itself.
func appendString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			// A copy, so that s does not escape: an answer's limits can
			// then stay on the handler's stack.
			q, _ := json.Marshal(strings.Clone(s)) // a string always encodes
			return append(dst, q...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// httpDate is a Date header's value and the second it names.
type httpDate struct {
	unix int64
	val  []string // full: an Add to the header copies it
}

// lastDate is the Date of the latest answers. Formatting it once a second,
// rather than net/http formatting it for every answer that has none
// (time.Time.AppendFormat, 1.7 % of a five-limit admit's CPU), gives
// byte for byte the same header.
var lastDate atomic.Pointer[httpDate]

// dateOf returns the Date header's value for an answer made at now.
func dateOf(now time.Time) []string {
	sec := now.Unix()
	if d := lastDate.Load(); d != nil && d.unix == sec {
		return d.val
	}
	d := &httpDate{unix: sec, val: []string{now.UTC().Format(http.TimeFormat)}}
	lastDate.Store(d)
	return d.val
}
