package events

import (
	"strconv"
	"time"
)

// The events published once per request — Reserved by admission for
// every admit, Actual (or Released) by admission for every report of
// POST /v1/usage, Corrected by the accounter for every actual — are
// encoded by hand: encoding/json's reflection was half of admission's
// cost of publishing. The output is byte for byte what MarshalJSON's json.Encoder
// makes (TestFastJSONMatches and FuzzFastJSON hold it to that); anything
// unusual (a string that needs escaping, a time MarshalJSON refuses) is
// left to encoding/json.

// appendFast appends the JSON envelope of e when its data is a Reserved,
// a Corrected, an Actual or a Released and every field takes the plain
// path; ok is false otherwise, and dst is then to be discarded.
func appendFast(dst []byte, e *Event) (_ []byte, ok bool) {
	switch e.Data.(type) {
	case Reserved, Corrected, Actual, Released:
	default:
		return dst, false
	}
	tenant, user := e.Data.tenantUser()
	w := fastWriter{b: dst, ok: true}
	w.strField(`{"specversion":"`+SpecVersion+`","id":`, e.ID)
	w.strField(`,"source":`, e.Source)
	w.strField(`,"type":`, e.Data.Type())
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
	case Actual:
		w.actual(&d)
	case Released:
		w.released(&d)
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

// Field writers: key is the JSON before the value, with its comma or
// brace, e.g. `,"tenant":`; the opt ones leave out a zero value, as
// omitempty does.
func (w *fastWriter) strField(key, s string) { w.raw(key); w.str(s) }

func (w *fastWriter) optStr(key, s string) {
	if s != "" {
		w.strField(key, s)
	}
}

func (w *fastWriter) intField(key string, v int64) { w.raw(key); w.int(v) }

func (w *fastWriter) optInt(key string, v int64) {
	if v != 0 {
		w.intField(key, v)
	}
}

func (w *fastWriter) reserved(d *Reserved) {
	w.strField(`{"request_id":`, d.RequestID)
	w.strField(`,"tenant":`, d.Tenant)
	w.strField(`,"user":`, d.User)
	w.optStr(`,"plan":`, d.Plan)
	w.strField(`,"endpoint":`, d.Endpoint)
	w.optStr(`,"model":`, d.Model)
	w.optStr(`,"ip":`, d.IP)
	w.intField(`,"estimated_tokens":`, d.EstimatedTokens)
	w.raw(`,"expires_at":`)
	w.time(d.ExpiresAt)
	w.intField(`,"version":`, d.Version)
	w.optInt(`,"tenant_version":`, d.TenantVersion)
	w.limits(d.Limits)
	if len(d.WouldDeny) > 0 {
		w.raw(`,"would_deny":[`)
		for i := range d.WouldDeny {
			if i > 0 {
				w.raw(",")
			}
			r := &d.WouldDeny[i]
			w.strField(`{"scope":`, r.Scope)
			w.strField(`,"name":`, r.Name)
			w.optStr(`,"endpoint":`, r.Endpoint)
			w.raw("}")
		}
		w.raw("]")
	}
	w.raw("}")
}

func (w *fastWriter) corrected(d *Corrected) {
	w.strField(`{"request_id":`, d.RequestID)
	w.strField(`,"tenant":`, d.Tenant)
	w.strField(`,"user":`, d.User)
	w.optStr(`,"plan":`, d.Plan)
	w.intField(`,"delta":`, d.Delta)
	w.intField(`,"version":`, d.Version)
	w.optInt(`,"tenant_version":`, d.TenantVersion)
	w.limits(d.Limits)
	w.raw("}")
}

func (w *fastWriter) actual(d *Actual) {
	w.strField(`{"request_id":`, d.RequestID)
	w.strField(`,"tenant":`, d.Tenant)
	w.strField(`,"user":`, d.User)
	w.optStr(`,"endpoint":`, d.Endpoint)
	w.optStr(`,"model":`, d.Model)
	w.intField(`,"input_tokens":`, d.InputTokens)
	w.intField(`,"output_tokens":`, d.OutputTokens)
	w.raw("}")
}

func (w *fastWriter) released(d *Released) {
	w.strField(`{"request_id":`, d.RequestID)
	w.strField(`,"tenant":`, d.Tenant)
	w.strField(`,"user":`, d.User)
	w.optStr(`,"status":`, d.Status)
	w.optInt(`,"returned_tokens":`, d.ReturnedTokens)
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
		w.strField(`{"scope":`, l.Scope)
		w.strField(`,"name":`, l.Name)
		w.optStr(`,"endpoint":`, l.Endpoint)
		w.strField(`,"unit":`, l.Unit)
		w.intField(`,"limit":`, l.Limit)
		w.intField(`,"used":`, l.Used)
		w.intField(`,"remaining":`, l.Remaining)
		w.intField(`,"reset_seconds":`, l.ResetSeconds)
		w.raw("}")
	}
	w.raw("]")
}
