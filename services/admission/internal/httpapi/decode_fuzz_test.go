package httpapi

import (
	"encoding/json"
	"net/netip"
	"testing"
	"unicode/utf8"

	"quotaflow/pkg/limits"
)

// FuzzDecodeAdmit checks the POST /v1/admit decoder on arbitrary bodies:
// it never panics; what it accepts satisfies every rule of DESIGN §4 and
// survives a round trip; what it rejects names a field in a printable,
// valid UTF-8 message. Seeds live in testdata/fuzz/FuzzDecodeAdmit.
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
			if len(v) > limits.MaxID || !utf8.ValidString(v) {
				t.Fatalf("accepted %s %q", name, v)
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
