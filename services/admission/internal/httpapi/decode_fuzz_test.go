package httpapi

import (
	"encoding/json"
	"net/netip"
	"testing"
	"unicode/utf8"

	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
)

// FuzzDecodeAdmit checks the POST /v1/admit decoder on arbitrary bodies:
// it never panics; what it accepts satisfies every rule of DESIGN §4 (the
// identifiers pass ident.Check) and survives a round trip; what it rejects
// names a field in a printable, valid UTF-8 message. Seeds live in testdata/fuzz/FuzzDecodeAdmit.
func FuzzDecodeAdmit(f *testing.F) {
	pol := mustPolicy(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		in, ferr := decodeAdmit(body, pol.Cost)
		if ferr != nil {
			if ferr.field == "" || ferr.problem == "" {
				t.Fatalf("error without field or problem: %q", ferr.Error())
			}
			if msg := ferr.Error(); !utf8.ValidString(msg) || len(msg) > 1024 {
				t.Fatalf("error message is not short valid UTF-8: %q", msg)
			}
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
