package events

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// del marks a key to delete in a mutation.
type delT struct{}

var del delT

// mutate returns the encoded example of typ with path (dot-separated keys
// and array indexes) set to v, or deleted when v is del.
func mutate(t *testing.T, typ, path string, v any) []byte {
	t.Helper()
	b, err := Encode(exampleOf(t, typ))
	if err != nil {
		t.Fatal(err)
	}
	var root any
	if err := json.Unmarshal(b, &root); err != nil {
		t.Fatal(err)
	}
	keys := strings.Split(path, ".")
	cur := root
	for i, k := range keys {
		last := i == len(keys)-1
		switch c := cur.(type) {
		case map[string]any:
			if last {
				if v == del {
					delete(c, k)
				} else {
					c[k] = v
				}
			} else {
				cur = c[k]
			}
		case []any:
			n, err := strconv.Atoi(k)
			if err != nil || n >= len(c) {
				t.Fatalf("bad path %s", path)
			}
			if last {
				c[n] = v
			} else {
				cur = c[n]
			}
		default:
			t.Fatalf("bad path %s", path)
		}
	}
	out, err := json.Marshal(root)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDecodeValidation(t *testing.T) {
	long := strings.Repeat("x", MaxID+1)
	maxed := strings.Repeat("é", MaxID/2) // exactly MaxID bytes
	raw := func(s string) json.RawMessage { return json.RawMessage(s) }
	const ok = ""
	tests := []struct {
		typ, path string
		v         any
		want      string // substring of the error; "" means valid
	}{
		// Envelope.
		{TypeActual, "specversion", "0.3", `specversion: must be "1.0"`},
		{TypeActual, "specversion", del, `specversion: must be "1.0"`},
		{TypeActual, "id", "", "id: required"},
		{TypeActual, "id", del, "id: required"},
		{TypeActual, "id", "has space", "id: must be printable ASCII"},
		{TypeActual, "id", "é", "id: must be printable ASCII"},
		{TypeActual, "id", long, "id: longer than 256 bytes"},
		{TypeActual, "id", 5, "id: must be a string"},
		{TypeActual, "id", "any-uuid-like-id-4f1c", ok},
		{TypeActual, "source", del, "source: required"},
		{TypeActual, "source", long, "source: longer than 256 bytes"},
		{TypeActual, "type", del, "type: required"},
		{TypeActual, "type", "quotaflow.usage.bogus", `type: unknown type "quotaflow.usage.bogus"`},
		{TypeActual, "type", TypeReleased, ok}, // actual's data has every released field
		{TypeActual, "type", TypeTopUp, "data.amount: required"},
		{TypeActual, "time", del, "time: required"},
		{TypeActual, "time", "yesterday", "time: must be an RFC 3339 time"},
		{TypeActual, "time", "2025-03-14 09:26:53Z", "time: must be an RFC 3339 time"},
		{TypeActual, "time", "2025-03-14T09:26:53.123456+02:00", ok},
		{TypeActual, "time", 1741944413, "time: must be an RFC 3339 time"},
		{TypeActual, "subject", del, ok},
		{TypeActual, "subject", "acme/u-43", "subject: must be data's"},
		{TypeActual, "datacontenttype", "text/plain", `datacontenttype: must be "application/json"`},
		{TypeActual, "datacontenttype", del, `datacontenttype: must be "application/json"`},
		{TypeActual, "data", del, "data: required"},
		{TypeActual, "data", nil, "data: required"},
		{TypeActual, "data", "x", "data: must be a JSON object"},
		{TypeActual, "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ok},

		// reserved
		{TypeReserved, "data.request_id", del, "data.request_id: required"},
		{TypeReserved, "data.tenant", "", "data.tenant: required"},
		{TypeReserved, "data.tenant", long, "data.tenant: longer than 256 bytes"},
		{TypeReserved, "data.tenant", maxed, "subject"}, // valid tenant; only the subject no longer matches
		{TypeReserved, "data.user", del, "data.user: required"},
		{TypeReserved, "data.user", 42, "data.user: must be a string"},
		{TypeReserved, "data.user", "a\x00b", "data.user: contains a control character"},
		{TypeReserved, "data.user", "a\tb", "data.user: contains a control character"},
		{TypeReserved, "data.tenant", "acme\x00", "data.tenant: contains a control character"},
		{TypeReserved, "data.tenant", "a\x7f", "data.tenant: contains a control character"},   // DEL, raw in the JSON
		{TypeReserved, "data.tenant", "a\u0085", "data.tenant: contains a control character"}, // C1 (NEL), raw
		{TypeReserved, "data.tenant", "a\u00a0\u2028", "subject"},                             // not Cc: valid
		{TypeReserved, "data.request_id", "r\x1b[31m", "data.request_id: contains a control character"},
		{TypeReserved, "data.endpoint", "/x\n", "data.endpoint: contains a control character"},
		{TypeReserved, "data.model", "m\x00", "data.model: contains a control character"},
		{TypeReserved, "data.plan", "p\u009f", "data.plan: contains a control character"},
		{TypeReserved, "data.limits", []map[string]any{{"scope": "user", "name": "5h\x00", "unit": "tokens", "limit": 1, "used": 0, "remaining": 1, "reset_seconds": 0}},
			"data.limits[0].name: contains a control character"},
		{TypeActual, "source", "svc\x00", "source: contains a control character"},
		{TypeTopUp, "data.reference", "pay\x00", "data.reference: contains a control character"},
		{TypeDenied, "data.user", "u\x01", "data.user: contains a control character"},
		{TypeReleased, "data.user", "u\x00", "data.user: contains a control character"},
		{TypeCorrected, "data.tenant", "t\x00", "data.tenant: contains a control character"},
		{TypeReserved, "data.endpoint", del, "data.endpoint: required"},
		{TypeReserved, "data.plan", del, ok},
		{TypeReserved, "data.plan", long, "data.plan: longer than 256 bytes"},
		{TypeCorrected, "data.plan", del, ok}, // from an accounter older than the field
		{TypeCorrected, "data.plan", "p\u009f", "data.plan: contains a control character"},
		{TypeCorrected, "data.plan", long, "data.plan: longer than 256 bytes"},
		{TypeReserved, "data.model", del, ok},
		{TypeReserved, "data.model", long, "data.model: longer"},
		{TypeReserved, "data.ip", del, ok},
		{TypeReserved, "data.ip", "not-an-ip", "data.ip: not an IP address"},
		{TypeReserved, "data.ip", "::ffff:10.0.0.1", ok},
		{TypeReserved, "data.estimated_tokens", -1, "data.estimated_tokens: must be >= 0"},
		{TypeReserved, "data.estimated_tokens", MaxCount + 1, "data.estimated_tokens: must be <= 1000000000000"},
		{TypeReserved, "data.estimated_tokens", MaxCount, ok},
		{TypeReserved, "data.version", int64(1_800_000_000_000_000), ok}, // µs of Redis time
		{TypeReserved, "data.version", int64(MaxVersion) + 1, "data.version: must be <= 9007199254740991"},
		{TypeCorrected, "data.tenant_version", -1, "data.tenant_version: must be >= 0"},
		{TypeReserved, "data.estimated_tokens", 0, ok},
		{TypeReserved, "data.estimated_tokens", 1.5, "data.estimated_tokens: must be an integer"},
		{TypeReserved, "data.estimated_tokens", raw("1e3"), "data.estimated_tokens: must be an integer"},
		{TypeReserved, "data.estimated_tokens", raw("99999999999999999999"), "data.estimated_tokens: must be an integer"},
		{TypeReserved, "data.estimated_tokens", "12", "data.estimated_tokens: must be an integer"},
		{TypeReserved, "data.estimated_tokens", del, "data.estimated_tokens: required"},
		{TypeReserved, "data.estimated_tokens", nil, "data.estimated_tokens: required"},
		{TypeReserved, "data.expires_at", del, "data.expires_at: required"},
		{TypeReserved, "data.expires_at", "soon", "data.expires_at: must be an RFC 3339 time"},
		{TypeReserved, "data.version", del, "data.version: required"},
		{TypeReserved, "data.version", -1, "data.version: must be >= 0"},
		{TypeReserved, "data.tenant_version", del, ok},
		{TypeReserved, "data.tenant_version", -1, "data.tenant_version: must be >= 0"},
		{TypeReserved, "data.limits", del, ok},
		{TypeReserved, "data.limits", []any{}, ok},
		{TypeReserved, "data.limits", "x", "data.limits: must be an array"},
		{TypeReserved, "data.limits", []any{1}, "data.limits[0]: must be a JSON object"},
		{TypeReserved, "data.limits.0.scope", "planet", `data.limits[0].scope: must be "ip", "global", "tenant" or "user"`},
		{TypeReserved, "data.limits.0.scope", del, "data.limits[0].scope: required"},
		{TypeReserved, "data.limits.1.name", del, "data.limits[1].name: required"},
		{TypeReserved, "data.limits.1.endpoint", long, "data.limits[1].endpoint: longer"},
		{TypeReserved, "data.limits.0.unit", "bytes", `data.limits[0].unit: must be "tokens" or "requests"`},
		{TypeReserved, "data.limits.0.unit", del, "data.limits[0].unit: required"},
		{TypeReserved, "data.limits.0.limit", del, "data.limits[0].limit: required"},
		{TypeReserved, "data.limits.0.limit", MaxCount + 1, "data.limits[0].limit: must be <="},
		{TypeReserved, "data.limits.0.used", -5, "data.limits[0].used: must be >= 0"},
		{TypeReserved, "data.limits.0.remaining", del, "data.limits[0].remaining: required"},
		{TypeReserved, "data.limits.0.remaining", -5, ok},
		{TypeReserved, "data.limits.0.remaining", -MaxCount - 1, "data.limits[0].remaining: must be between"},
		{TypeReserved, "data.limits.1.reset_seconds", -1, "data.limits[1].reset_seconds: must be >= 0"},
		{TypeReserved, "data.limits.1.reset_seconds", "soon", "data.limits[1].reset_seconds: must be an integer"},
		{TypeReserved, "data.would_deny", "x", "data.would_deny: must be an array"},
		{TypeReserved, "data.would_deny.0.scope", "", "data.would_deny[0].scope: required"},
		{TypeReserved, "data.would_deny.1.name", del, "data.would_deny[1].name: required"},

		// denied
		{TypeDenied, "data.tenant", del, "data.tenant: required"},
		{TypeDenied, "data.user", del, "data.user: required"},
		{TypeDenied, "data.ip", "1.2.3.4.5", "data.ip: not an IP address"},
		{TypeDenied, "data.ip", del, ok}, // the id no longer matches; ids are not enforced
		{TypeDenied, "data.endpoint", del, "data.endpoint: required"},
		{TypeDenied, "data.scope", "everyone", "data.scope: must be"},
		{TypeDenied, "data.name", long, "data.name: longer"},
		{TypeDenied, "data.count", 0, "data.count: must be >= 1"},
		{TypeDenied, "data.count", del, "data.count: required"},

		// actual
		{TypeActual, "data.request_id", "", "data.request_id: required"},
		{TypeActual, "data.tenant", del, "data.tenant: required"},
		{TypeActual, "data.user", long, "data.user: longer than 256 bytes"},
		{TypeActual, "data.endpoint", del, ok},
		{TypeActual, "data.model", del, ok},
		{TypeActual, "data.input_tokens", -1, "data.input_tokens: must be >= 0"},
		{TypeActual, "data.input_tokens", MaxCount + 1, "data.input_tokens: must be <= 1000000000000"},
		{TypeActual, "data.input_tokens", 0, ok},
		{TypeActual, "data.output_tokens", del, "data.output_tokens: required"},
		{TypeActual, "data.output_tokens", true, "data.output_tokens: must be an integer"},
		{TypeActual, "data.Output_tokens", 5, ok}, // unknown key, ignored

		// released
		{TypeReleased, "data.request_id", del, "data.request_id: required"},
		{TypeReleased, "data.tenant", "", "data.tenant: required"},
		{TypeReleased, "data.user", long, "data.user: longer"},

		// corrected
		{TypeCorrected, "data.request_id", del, "data.request_id: required"},
		{TypeCorrected, "data.delta", del, "data.delta: required"},
		{TypeCorrected, "data.delta", -MaxCount - 1, "data.delta: must be between -1000000000000 and 1000000000000"},
		{TypeCorrected, "data.delta", MaxCount + 1, "data.delta: must be between"},
		{TypeCorrected, "data.delta", 0, ok},
		{TypeCorrected, "data.version", del, "data.version: required"},
		{TypeCorrected, "data.limits.0.used", raw("1.0"), "data.limits[0].used: must be an integer"},

		// topup
		{TypeTopUp, "data.tenant", del, "data.tenant: required"},
		{TypeTopUp, "data.user", del, "subject"}, // user is optional; the subject no longer matches
		{TypeTopUp, "data.amount", 0, "data.amount: must be >= 1"},
		{TypeTopUp, "data.amount", -5, "data.amount: must be >= 1"},
		{TypeTopUp, "data.amount", MaxCount + 1, "data.amount: must be <="},
		{TypeTopUp, "data.reference", del, "data.reference: required"},
		{TypeTopUp, "data.reference", long, "data.reference: longer"},
	}
	for _, tc := range tests {
		name := tc.typ[strings.LastIndexByte(tc.typ, '.')+1:] + "/" + tc.path
		t.Run(name, func(t *testing.T) {
			b := mutate(t, tc.typ, tc.path, tc.v)
			checkDecode(t, "Decode", Decode, b, tc.want)
			// The accounter's decoding checks all of it but the snapshot.
			want := tc.want
			if strings.HasPrefix(tc.path, "data.limits") || strings.HasPrefix(tc.path, "data.would_deny") {
				want = ok
			}
			checkDecode(t, "Decoder{NoSnapshots: true}.Decode", Decoder{NoSnapshots: true}.Decode, b, want)
		})
	}
}

// checkDecode checks that decode, called name, finds b valid when want is
// empty and else fails with an error wrapping ErrInvalid that holds want.
func checkDecode(t *testing.T, name string, decode func([]byte) (Event, error), b []byte, want string) {
	t.Helper()
	_, err := decode(b)
	switch {
	case want == "" && err != nil:
		t.Errorf("%s(%s) = %v, want nil", name, b, err)
	case want == "":
	case err == nil:
		t.Errorf("%s(%s) = nil, want error %q", name, b, want)
	case !errors.Is(err, ErrInvalid):
		t.Errorf("%s(%s) = %v, does not wrap ErrInvalid", name, b, err)
	case !strings.Contains(err.Error(), want):
		t.Errorf("%s(%s) = %v, want %q", name, b, err, want)
	}
}

func TestDecodeMalformed(t *testing.T) {
	good, err := Encode(exampleOf(t, TypeActual))
	if err != nil {
		t.Fatal(err)
	}
	g := string(good)
	pad := `"pad":"` + strings.Repeat("x", MaxEventSize) + `",`
	tests := []struct {
		name, in, want string
	}{
		{"empty", "", "event: not valid JSON"},
		{"array", "[" + g + "]", "event: must be a JSON object"},
		{"string", `"x"`, "event: must be a JSON object"},
		{"truncated", g[:len(g)-5], "event: not valid JSON"},
		{"trailing", g + `{}`, "event: not valid JSON: invalid character '{' after top-level value"},
		{"trailing garbage", g + `x`, "event:"},
		{"too large", "{" + pad + g[1:], "larger than 65536"},
		{"invalid utf-8", strings.Replace(g, "acme", "ac\xffme", 1), "event: not valid UTF-8"},
		{"duplicate envelope key", `{"id":"x",` + g[1:], `event: duplicate key "id"`},
		{"duplicate data key", strings.Replace(g, `"tenant":"acme"`, `"tenant":"acme","tenant":"evil"`, 1), `data: duplicate key "tenant"`},
		{"escaped duplicate key", strings.Replace(g, `"tenant":"acme"`, `"tenant":"acme","ten\u0061nt":"evil"`, 1), `data: duplicate key "tenant"`},
		{"case variant key", strings.Replace(g, `"tenant":"acme"`, `"Tenant":"acme"`, 1), "data.tenant: required"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode([]byte(tc.in))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Decode(%.80q) = %v, want ErrInvalid with %q", tc.in, err, tc.want)
			}
		})
	}

	dupItem := mutate(t, TypeReserved, "data.limits.0.scope", "user")
	dupItem = []byte(strings.Replace(string(dupItem), `"scope":"user"`, `"scope":"user","scope":"ip"`, 1))
	if _, err := Decode(dupItem); err == nil || !strings.Contains(err.Error(), `data.limits[0]: duplicate key "scope"`) {
		t.Errorf("Decode(limits item with duplicate key) = %v", err)
	}
}

func TestDecodeListsProblems(t *testing.T) {
	_, err := Decode([]byte(`{"specversion":"1.0","type":"quotaflow.usage.actual",` +
		`"data":{"request_id":"r","tenant":"t","user":"u","input_tokens":-1}}`))
	if err == nil {
		t.Fatal("Decode = nil, want errors")
	}
	for _, want := range []string{"id: required", "source: required", "time: required", "datacontenttype",
		"data.output_tokens: required", "data.input_tokens: must be >= 0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Decode error %q lacks %q", err, want)
		}
	}

	_, err = Decode([]byte(`{"type":"quotaflow.usage.reserved","data":{}}`))
	if err == nil || !strings.Contains(err.Error(), "; and ") {
		t.Fatalf("Decode(many problems) = %v, want a capped list", err)
	}
	if n := strings.Count(err.Error(), "; "); n != maxProblems {
		t.Errorf("Decode error lists %d problems, want %d and a count: %v", n, maxProblems, err)
	}
}

func TestValidateGo(t *testing.T) {
	ok := exampleOf(t, TypeActual)
	d := ok.Data.(Actual)
	withData := func(d Data) Event { e := ok; e.Data = d; return e }
	bad := d
	bad.Tenant = "ac\xffme"
	nul := d
	nul.User = "u\x00"
	tests := []struct {
		name string
		ev   Event
		want string
	}{
		{"nil data", withData(nil), "data: required"},
		{"pointer data", withData(&d), "data: must be a value of a data type, not *events.Actual"},
		{"invalid utf-8", withData(bad), "data.tenant: not valid UTF-8"},
		{"NUL in user", withData(nul), "data.user: contains a control character"},
		{"zero time", func() Event { e := ok; e.Time = time.Time{}; return e }(), "time: required"},
		{"year 10000", func() Event { e := ok; e.Time = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC); return e }(), "time: year"},
		{"no id", func() Event { e := ok; e.ID = ""; return e }(), "id: required"},
		{"no source", func() Event { e := ok; e.Source = ""; return e }(), "source: required"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.ev.Validate()
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want ErrInvalid with %q", err, tc.want)
			}
			if _, err := Encode(tc.ev); !errors.Is(err, ErrInvalid) {
				t.Errorf("Encode() = %v, want ErrInvalid", err)
			}
		})
	}

	// Identifiers are any UTF-8 but control characters: two pairs never
	// collide, and the longest allowed passes.
	odd := Actual{RequestID: strings.Repeat("r", MaxID), Tenant: "a/b\"\\\u2028<&>", User: "\u00a0 \ufffd東京", InputTokens: 1}
	ev := NewActual("s", odd, testNow)
	b, err := Encode(ev)
	if err != nil {
		t.Fatalf("Encode(odd identifiers) = %v", err)
	}
	got, err := Decode(b)
	if err != nil || got.Data.(Actual) != odd {
		t.Errorf("Decode(Encode(odd identifiers)) = %+v, %v", got.Data, err)
	}
	if !utf8.Valid(b) || strings.Contains(string(b), `\u003c`) {
		t.Errorf("Encode escapes HTML or emits invalid UTF-8: %s", b)
	}

	huge := exampleOf(t, TypeReserved)
	r := huge.Data.(Reserved)
	for range 400 {
		r.Limits = append(r.Limits, LimitState{Scope: "user", Name: strings.Repeat("n", 200), Unit: "tokens"})
	}
	huge.Data = r
	if _, err := Encode(huge); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Encode(huge) = %v, want a size error", err)
	}
}
