package events

import (
	"strconv"
	"time"
)

// The two events published once per request — Reserved by admission for
// every admit, Corrected by the accounter for every actual — are encoded
// by hand: encoding/json's reflection was half of admission's cost of
// publishing. The output is byte for byte what MarshalJSON's json.Encoder
// makes (TestFastJSONMatches and FuzzFastJSON hold it to that); anything
// unusual (a string that needs escaping, a time MarshalJSON refuses) is
// left to encoding/json.

// appendFast appends the JSON envelope of e when its data is a Reserved or
// a Corrected and every field takes the plain path; ok is false otherwise,
// and dst is then to be discarded.
func appendFast(dst []byte, e *Event) (_ []byte, ok bool) {
	var tenant, user string
	switch d := e.Data.(type) {
	case Reserved:
		tenant, user = d.Tenant, d.User
	case Corrected:
		tenant, user = d.Tenant, d.User
	default:
		return dst, false
	}
	w := fastWriter{b: dst, ok: true}
	w.raw(`{"specversion":"` + SpecVersion + `","id":`)
	w.str(e.ID)
	w.raw(`,"source":`)
	w.str(e.Source)
	w.raw(`,"type":`)
	w.str(e.Data.Type())
	w.raw(`,"time":`)
	w.time(e.Time)
	w.raw(`,"subject":`)
	w.str2(tenant, user)
	w.raw(`,"datacontenttype":"` + DataContentType + `","data":`)
	switch d := e.Data.(type) {
	case Reserved:
		w.reserved(&d)
	case Corrected:
		w.corrected(&d)
	}
	w.raw("}")
	return w.b, w.ok
}

// fastWriter appends JSON; ok turns false at the first value it cannot
// write as encoding/json would.
type fastWriter struct {
	b  []byte
	ok bool
}

func (w *fastWriter) raw(s string) { w.b = append(w.b, s...) }

func (w *fastWriter) int(v int64) { w.b = strconv.AppendInt(w.b, v, 10) }

// str writes s quoted when it needs no escaping: printable ASCII without
// '"' and '\' (encoding/json with HTML escaping off writes those bytes as
// they are).
func (w *fastWriter) str(s string) {
	w.b = append(w.b, '"')
	w.chars(s)
	w.b = append(w.b, '"')
}

// str2 writes the subject "<tenant>/<user>" without building it.
func (w *fastWriter) str2(tenant, user string) {
	w.b = append(w.b, '"')
	w.chars(tenant)
	w.b = append(w.b, '/')
	w.chars(user)
	w.b = append(w.b, '"')
}

func (w *fastWriter) chars(s string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			w.ok = false
			return
		}
	}
	w.b = append(w.b, s...)
}

// time writes t as time.Time.MarshalJSON does: its text form (which
// refuses what MarshalJSON refuses) in quotes.
func (w *fastWriter) time(t time.Time) {
	b, err := t.AppendText(append(w.b, '"'))
	if err != nil {
		w.ok = false
		return
	}
	w.b = append(b, '"')
}

func (w *fastWriter) reserved(d *Reserved) {
	w.raw(`{"request_id":`)
	w.str(d.RequestID)
	w.raw(`,"tenant":`)
	w.str(d.Tenant)
	w.raw(`,"user":`)
	w.str(d.User)
	if d.Plan != "" {
		w.raw(`,"plan":`)
		w.str(d.Plan)
	}
	w.raw(`,"endpoint":`)
	w.str(d.Endpoint)
	if d.Model != "" {
		w.raw(`,"model":`)
		w.str(d.Model)
	}
	if d.IP != "" {
		w.raw(`,"ip":`)
		w.str(d.IP)
	}
	w.raw(`,"estimated_tokens":`)
	w.int(d.EstimatedTokens)
	w.raw(`,"expires_at":`)
	w.time(d.ExpiresAt)
	w.raw(`,"version":`)
	w.int(d.Version)
	if d.TenantVersion != 0 {
		w.raw(`,"tenant_version":`)
		w.int(d.TenantVersion)
	}
	w.limits(d.Limits)
	if len(d.WouldDeny) > 0 {
		w.raw(`,"would_deny":[`)
		for i := range d.WouldDeny {
			if i > 0 {
				w.raw(",")
			}
			r := &d.WouldDeny[i]
			w.raw(`{"scope":`)
			w.str(r.Scope)
			w.raw(`,"name":`)
			w.str(r.Name)
			if r.Endpoint != "" {
				w.raw(`,"endpoint":`)
				w.str(r.Endpoint)
			}
			w.raw("}")
		}
		w.raw("]")
	}
	w.raw("}")
}

func (w *fastWriter) corrected(d *Corrected) {
	w.raw(`{"request_id":`)
	w.str(d.RequestID)
	w.raw(`,"tenant":`)
	w.str(d.Tenant)
	w.raw(`,"user":`)
	w.str(d.User)
	w.raw(`,"delta":`)
	w.int(d.Delta)
	w.raw(`,"version":`)
	w.int(d.Version)
	if d.TenantVersion != 0 {
		w.raw(`,"tenant_version":`)
		w.int(d.TenantVersion)
	}
	w.limits(d.Limits)
	w.raw("}")
}

// limits writes `,"limits":[...]`, omitted when empty.
func (w *fastWriter) limits(ls []LimitState) {
	if len(ls) == 0 {
		return
	}
	w.raw(`,"limits":[`)
	for i := range ls {
		if i > 0 {
			w.raw(",")
		}
		l := &ls[i]
		w.raw(`{"scope":`)
		w.str(l.Scope)
		w.raw(`,"name":`)
		w.str(l.Name)
		if l.Endpoint != "" {
			w.raw(`,"endpoint":`)
			w.str(l.Endpoint)
		}
		w.raw(`,"unit":`)
		w.str(l.Unit)
		w.raw(`,"limit":`)
		w.int(l.Limit)
		w.raw(`,"used":`)
		w.int(l.Used)
		w.raw(`,"remaining":`)
		w.int(l.Remaining)
		w.raw(`,"reset_seconds":`)
		w.int(l.ResetSeconds)
		w.raw("}")
	}
	w.raw("]")
}
