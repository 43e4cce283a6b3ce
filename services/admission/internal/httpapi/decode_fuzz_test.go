package httpapi

import (
	"encoding/json"
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"quotaflow/pkg/events"
	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
)

// FuzzDecodeAdmit checks the POST /v1/admit decoder on arbitrary bodies:
// it never panics; what it accepts satisfies every rule of docs/design.md §4 (the
// identifiers pass ident.Check) and survives a round trip; what it rejects
// names a field in a printable, valid UTF-8 message. Seeds live in testdata/fuzz/FuzzDecodeAdmit.
func FuzzDecodeAdmit(f *testing.F) {
	pol := mustPolicy(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		in, ferr := decodeAdmit(body, pol.Cost)
		if ferr != nil {
			checkFieldError(t, ferr)
			return
		}
		for name, v := range map[string]string{"tenant": in.Tenant, "user": in.User, "endpoint": in.Endpoint} {
			if v == "" {
				t.Fatalf("accepted an empty %s: %q", name, body)
			}
		}
		for name, v := range map[string]string{"request_id": in.RequestID, "tenant": in.Tenant, "user": in.User,
			"plan": in.Plan, "endpoint": in.Endpoint, "model": in.Model} {
			if err := ident.Check(v); err != nil {
				t.Fatalf("accepted %s %q: %v", name, v, err)
			}
		}
		if in.Cost < 0 || in.Cost > limits.MaxCost {
			t.Fatalf("accepted cost %d", in.Cost)
		}
		if in.IP != "" {
			a, err := netip.ParseAddr(in.IP)
			if err != nil || a.String() != in.IP || a.Is4In6() || a.Zone() != "" {
				t.Fatalf("accepted ip %q, not canonical", in.IP)
			}
		}
		// Round trip: the accepted request, written out again, decodes to
		// the same input.
		cost := in.Cost
		again, err := json.Marshal(admitBody{RequestID: in.RequestID, Tenant: in.Tenant, User: in.User, Plan: in.Plan,
			IP: in.IP, Endpoint: in.Endpoint, Model: in.Model, EstimatedTokens: &cost})
		if err != nil {
			t.Fatal(err)
		}
		in2, ferr := decodeAdmit(again, pol.Cost)
		if ferr != nil || in2 != in {
			t.Fatalf("round trip of %q: %+v, %v; want %+v", again, in2, ferr, in)
		}
	})
}

// checkFieldError fails unless a rejection names a field and a problem in
// a short, valid UTF-8 message.
func checkFieldError(t *testing.T, ferr *fieldError) {
	t.Helper()
	if ferr.field == "" || ferr.problem == "" {
		t.Fatalf("error without field or problem: %q", ferr.Error())
	}
	if msg := ferr.Error(); !utf8.ValidString(msg) || len(msg) > 1024 {
		t.Fatalf("error message is not short valid UTF-8: %q", msg)
	}
}

// FuzzDecodeUsage checks the POST /v1/usage decoder on arbitrary bodies: it
// never panics; what it rejects names a field in a short valid UTF-8
// message; what it accepts is a non-empty list of valid actual or released
// events whose identifiers pass ident.Check, whose counts lie in 0 to
// 10^12, whose times are not ahead of now and whose ids are derived, never
// the caller's; and that list, written out again with events.Encode,
// decodes to the same events; and that it decides as decoding each element
// alone (decodeUsageSlow) does. Seeds live in testdata/fuzz/FuzzDecodeUsage.
// The stream's age here is a century, so the seeds' fixed times pass.
func FuzzDecodeUsage(f *testing.F) {
	f.Add([]byte("[" + actualJSON("e1", "acme", 5) + "]"))
	const century = 100 * 365 * 24 * time.Hour
	f.Fuzz(func(t *testing.T, body []byte) {
		now := time.Now()
		evs, ferr := decodeUsage(body, now, century)
		// The one pass over the whole array decides as decoding each
		// element alone does.
		wantEvs, wantErrs, wantFerr := decodeUsageSlow(body)
		if wantFerr == nil {
			wantEvs, wantFerr = reportedEvents(wantEvs, wantErrs, now, century)
		}
		if !reflect.DeepEqual(evs, wantEvs) || !reflect.DeepEqual(ferr, wantFerr) {
			t.Fatalf("decodeUsage(%q) = %+v, %v; each element alone: %+v, %v", body, evs, ferr, wantEvs, wantFerr)
		}
		if ferr != nil {
			checkFieldError(t, ferr)
			return
		}
		if len(evs) == 0 {
			t.Fatalf("accepted no events: %q", body)
		}
		again := []byte{'['}
		for i, ev := range evs {
			if err := ev.Validate(); err != nil {
				t.Fatalf("accepted event %d that Validate rejects: %v", i, err)
			}
			var ids []string
			switch d := ev.Data.(type) {
			case events.Actual:
				ids = []string{d.RequestID, d.Tenant, d.User, d.Endpoint, d.Model}
				if ev.ID != events.ID(events.TypeActual, d.Tenant, d.User, d.RequestID) {
					t.Fatalf("accepted event %d kept id %q, not the derived one", i, ev.ID)
				}
				if d.InputTokens < 0 || d.InputTokens > limits.MaxCost || d.OutputTokens < 0 || d.OutputTokens > limits.MaxCost {
					t.Fatalf("accepted counts %d, %d", d.InputTokens, d.OutputTokens)
				}
			case events.Released:
				ids = []string{d.RequestID, d.Tenant, d.User}
				if ev.ID != events.ID(events.TypeReleased, d.Tenant, d.User, d.RequestID) {
					t.Fatalf("accepted event %d kept id %q, not the derived one", i, ev.ID)
				}
			default:
				t.Fatalf("accepted a %s event", ev.Type())
			}
			if ev.Time.After(now.Add(events.MaxSkew)) {
				t.Fatalf("accepted event %d from the future: %s", i, ev.Time)
			}
			for _, v := range append(ids, ev.Source) {
				if err := ident.Check(v); err != nil {
					t.Fatalf("accepted identifier %q: %v", v, err)
				}
			}
			b, err := events.Encode(ev)
			if err != nil {
				// Re-encoding may grow past the size cap (U+2028 is
				// escaped); nothing else may fail.
				if errors.Is(err, events.ErrInvalid) && strings.Contains(err.Error(), "larger than") {
					return
				}
				t.Fatalf("Encode(accepted event %d) = %v", i, err)
			}
			if i > 0 {
				again = append(again, ',')
			}
			again = append(again, b...)
		}
		again = append(again, ']')
		evs2, ferr := decodeUsage(again, now, century)
		if ferr != nil || !reflect.DeepEqual(evs, evs2) {
			t.Fatalf("round trip of %q: %+v, %v; want %+v", again, evs2, ferr, evs)
		}
	})
}

// FuzzDecodeAdmitFast checks that the fast decoder accepts nothing that
// encoding/json (decodeStrict) would reject or read differently. Its
// testdata/fuzz holds a copy of FuzzDecodeAdmit's seeds; these add the
// edges of the fast decoder's grammar.
func FuzzDecodeAdmitFast(f *testing.F) {
	for _, s := range []string{
		`{}`, ` {} `, `{}x`, `{"tenant":"t",}`, `{"Tenant":"t"}`, `{"tenant":null}`, `{"tenant":"a\"b"}`,
		`{"estimated_tokens":1.0}`, `{"estimated_tokens":1e3}`, `{"estimated_tokens":0123}`, `{"estimated_tokens":-}`,
		`{"estimated_tokens":123456789012345678}`, `{"estimated_tokens":1234567890123456789}`, `{"estimated_tokens":-5}`,
		`{"estimated_tokens":"5"}`, `{"tenant":5}`, "{\"tenant\":\"a\tb\"}", `{"tenant":"\xff"}`, `{"x":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"tenant":"acme","user":"u-1","endpoint":"/v1/chat","estimated_tokens":100}`))
	f.Add([]byte(` { "request_id" : "r", "plan":"p","ip":"::1","model":"m","input_tokens":-0,"max_output_tokens":12 ,"tenant":"t","tenant":"é"} `))
	f.Fuzz(func(t *testing.T, body []byte) {
		fast, ok := decodeAdmitFast(body)
		if !ok {
			return
		}
		var strict admitBody
		if ferr := decodeStrict(body, &strict); ferr != nil {
			t.Fatalf("fast decoder accepted %q, decodeStrict rejects it: %v", body, ferr)
		}
		if !equalAdmitBody(fast, strict) {
			t.Fatalf("body %q: fast %+v, decodeStrict %+v", body, fast, strict)
		}
	})
}

func equalAdmitBody(a, b admitBody) bool {
	eq := func(x, y *int64) bool { return x == nil && y == nil || x != nil && y != nil && *x == *y }
	return a.RequestID == b.RequestID && a.Tenant == b.Tenant && a.User == b.User && a.Plan == b.Plan && a.IP == b.IP &&
		a.Endpoint == b.Endpoint && a.Model == b.Model &&
		eq(a.EstimatedTokens, b.EstimatedTokens) && eq(a.InputTokens, b.InputTokens) && eq(a.MaxOutputTokens, b.MaxOutputTokens)
}

// The bodies gateways send take the fast path.
func TestDecodeAdmitFastTakesTypicalBodies(t *testing.T) {
	for _, body := range []string{
		admitBodyOK,
		`{"request_id":"r-1","tenant":"acme","user":"u-1","plan":"pro","ip":"192.0.2.1","endpoint":"/v1/chat","model":"m","input_tokens":10,"max_output_tokens":20}`,
		"{\n  \"tenant\": \"acme\",\n  \"user\": \"é\",\n  \"endpoint\": \"/x\"\n}\n",
	} {
		b, ok := decodeAdmitFast([]byte(body))
		var strict admitBody
		if err := decodeStrict([]byte(body), &strict); !ok || err != nil || !equalAdmitBody(b, strict) {
			t.Errorf("decodeAdmitFast(%s) = %+v, %v; want %+v, true", body, b, ok, strict)
		}
	}
}
