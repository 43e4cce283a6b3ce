package events

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

var testNow = time.Date(2025, 3, 14, 9, 26, 53, 0, time.UTC)

// docOrigin is the origin of the denied events of the tests and of
// doc.go's example.
const docOrigin = "6KBU4LCEX3JKN7GDQVHL2ZYAPM"

// examples returns one event of each type with every field set.
func examples() []Event {
	ls := []LimitState{
		{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: 990, Remaining: 10, ResetSeconds: 1800},
		{Scope: "global", Name: "daily", Endpoint: "/api/v1/generate", Unit: "requests", Limit: 500, Used: 42, Remaining: 458, ResetSeconds: 52387},
	}
	return []Event{
		NewReserved("quotaflow/admission", Reserved{
			RequestID: "r-123", Tenant: "acme", User: "u-42", Plan: "pro", Endpoint: "/api/v1/generate",
			Model: "big-model", IP: "203.0.113.7", EstimatedTokens: 1200, ExpiresAt: testNow.Add(time.Hour),
			Version: 17, TenantVersion: 230, Limits: ls,
			WouldDeny: []LimitRef{{Scope: "tenant", Name: "month"}, {Scope: "user", Name: "daily", Endpoint: "/api/v1/generate"}},
		}, testNow),
		NewDenied("quotaflow/admission", Denied{
			Tenant: "acme", User: "u-42", IP: "2001:db8::7", Endpoint: "/api/v1/generate", Scope: "user", Name: "5h", Count: 3,
		}, testNow.Add(400*time.Millisecond), docOrigin),
		NewActual("billing-proxy", Actual{
			RequestID: "r-123", Tenant: "acme", User: "u-42", Endpoint: "/api/v1/generate", Model: "big-model",
			InputTokens: 800, OutputTokens: 350,
		}, testNow),
		NewReleased("quotaflow/admission", Released{RequestID: "r-124", Tenant: "acme", User: "u-42"}, testNow),
		NewCorrected("quotaflow/accounter", Corrected{
			RequestID: "r-123", Tenant: "acme", User: "u-42", Plan: "pro", Delta: -650, Version: 18, TenantVersion: 231, Limits: ls[:1],
		}, testNow),
		NewTopUp("quotaflow/admission", TopUp{Tenant: "acme", User: "u-42", Amount: 50000, Reference: "pay_8Hq2"}, testNow),
	}
}

func exampleOf(t *testing.T, typ string) Event {
	t.Helper()
	for _, ev := range examples() {
		if ev.Type() == typ {
			return ev
		}
	}
	t.Fatalf("no example of %s", typ)
	return Event{}
}

func TestRoundTrip(t *testing.T) {
	for _, ev := range examples() {
		t.Run(ev.Type(), func(t *testing.T) {
			b, err := Encode(ev)
			if err != nil {
				t.Fatalf("Encode(%s) = %v", ev.Type(), err)
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatalf("Decode(%s) = %v", b, err)
			}
			if !reflect.DeepEqual(got, ev) {
				t.Errorf("Decode(Encode(ev)) = %+v, want %+v", got, ev)
			}
			// Every field of the example is set, so a json tag that
			// disagrees with read would lose it above; check nothing is
			// written that read does not know either.
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatal(err)
			}
			if got, want := string(m["subject"]), `"acme/u-42"`; got != want {
				t.Errorf("subject = %s, want %s", got, want)
			}
			if got, want := string(m["type"]), `"`+ev.Type()+`"`; got != want {
				t.Errorf("type = %s, want %s", got, want)
			}
		})
	}
}

// TestDecoderNoSnapshots decodes every example, alone and in a batch, as
// the accounter does: the event Decode gives, without its snapshot.
func TestDecoderNoSnapshots(t *testing.T) {
	dec := Decoder{NoSnapshots: true}
	var all []Event
	for _, ev := range examples() {
		want := ev
		switch d := ev.Data.(type) {
		case Reserved:
			d.Limits, d.WouldDeny = nil, nil
			want.Data = d
		case Corrected:
			d.Limits = nil
			want.Data = d
		}
		all = append(all, want)
		b, err := Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := dec.Decode(b); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("Decode(%s) = %+v, %v, want %+v", b, got, err, want)
		}
	}
	b, err := EncodeBatch(examples())
	if err != nil {
		t.Fatal(err)
	}
	got, errs, _, err := dec.DecodeBatch(b)
	if err != nil || !reflect.DeepEqual(got, all) || slices.ContainsFunc(errs, func(e error) bool { return e != nil }) {
		t.Errorf("DecodeBatch = %+v, %v, %v, want %+v", got, errs, err, all)
	}
}

func TestZeroOptionalFieldsRoundTrip(t *testing.T) {
	evs := []Event{
		NewReserved("s", Reserved{RequestID: "r", Tenant: "t", User: "u", Endpoint: "/e", ExpiresAt: testNow}, testNow),
		NewActual("s", Actual{RequestID: "r", Tenant: "t", User: "u"}, testNow),
		NewCorrected("s", Corrected{RequestID: "r", Tenant: "t", User: "u"}, testNow),
		NewTopUp("s", TopUp{Tenant: "t", Amount: 1, Reference: "x"}, testNow),
	}
	for _, ev := range evs {
		b, err := Encode(ev)
		if err != nil {
			t.Fatalf("Encode(%+v) = %v", ev, err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("Decode(%s) = %v", b, err)
		}
		if !reflect.DeepEqual(got, ev) {
			t.Errorf("Decode(%s) = %+v, want %+v", b, got, ev)
		}
	}
}

// TestDocExamples decodes every JSON example of doc.go, so the
// documentation other languages rely on cannot drift from the code.
func TestDocExamples(t *testing.T) {
	f, err := os.Open("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var blocks []string
	var cur strings.Builder
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "//\t{":
			in = true
			cur.Reset()
			cur.WriteString("{")
		case in && line == "//\t}":
			cur.WriteString("}")
			blocks = append(blocks, cur.String())
			in = false
		case in:
			cur.WriteString(strings.TrimPrefix(line, "//\t"))
		}
	}
	if len(blocks) != 6 {
		t.Fatalf("doc.go has %d examples, want 6", len(blocks))
	}
	seen := map[string]bool{}
	for _, b := range blocks {
		ev, err := Decode([]byte(b))
		if err != nil {
			t.Errorf("Decode(doc example) = %v\n%s", err, b)
			continue
		}
		seen[ev.Type()] = true
		if want := derivedID(ev); ev.ID != want {
			t.Errorf("doc example %s has id %s, want %s", ev.Type(), ev.ID, want)
		}
	}
	if len(seen) != 6 {
		t.Errorf("doc examples cover %v, want all six types", seen)
	}
}

func derivedID(ev Event) string {
	switch d := ev.Data.(type) {
	case Denied:
		return DeniedID(d, ev.Time, docOrigin)
	case TopUp:
		return TopUpID(d.Tenant, d.Reference)
	}
	t, u := ev.Data.tenantUser()
	var rid string
	switch d := ev.Data.(type) {
	case Reserved:
		rid = d.RequestID
	case Actual:
		rid = d.RequestID
	case Released:
		rid = d.RequestID
	case Corrected:
		rid = d.RequestID
	}
	return ID(ev.Type(), t, u, rid)
}

func TestID(t *testing.T) {
	// The vector of doc.go, computed independently (Python hashlib).
	if got, want := ID(TypeActual, "acme", "u-42", "r-123"), "a2b7081b1f6328815ae20e245fd52556"; got != want {
		t.Errorf("ID(actual, acme, u-42, r-123) = %s, want %s", got, want)
	}
	if got, want := TopUpID("acme", "pay_8Hq2"), "80e380f3d4a4777071521e28ebc6dc6b"; got != want {
		t.Errorf("TopUpID(acme, pay_8Hq2) = %s, want %s", got, want)
	}
	distinct := [][2]string{
		{ID("a:b", "c", "", ""), ID("a", "b:c", "", "")},
		{ID(TypeActual, "ab", "c", "r"), ID(TypeActual, "a", "bc", "r")},
		{ID(TypeActual, "a/b", "c", "r"), ID(TypeActual, "a", "b/c", "r")},
		{ID(TypeActual, "t", "u", "r"), ID(TypeReserved, "t", "u", "r")},
		{ID(TypeActual, "t", "u\x00", "r"), ID(TypeActual, "t", "u", "\x00r")},
		{ID(TypeTopUp, "t", "", "ref"), TopUpID("t", "ref")},
		{TopUpID("t", "ref"), TopUpID("tr", "ef")},
	}
	for _, p := range distinct {
		if p[0] == p[1] {
			t.Errorf("ids collide: %s", p[0])
		}
	}
	if a, b := ID(TypeActual, "t", "u", "r"), ID(TypeActual, "t", "u", "r"); a != b || len(a) != 32 {
		t.Errorf("ID is not a stable 32-character id: %q, %q", a, b)
	}

	d := Denied{Tenant: "t", User: "u", Endpoint: "/e", Scope: "user", Name: "n", Count: 1}
	e1 := NewDenied("s", d, testNow.Add(100*time.Millisecond), "a")
	d.Count = 7
	e2 := NewDenied("s", d, testNow.Add(900*time.Millisecond), "a")
	e3 := NewDenied("s", d, testNow.Add(time.Second), "a")
	e4 := NewDenied("s", d, testNow, "b")
	if e1.ID != e2.ID {
		t.Errorf("denials of one second and origin have ids %s and %s, want one", e1.ID, e2.ID)
	}
	if e1.ID == e3.ID {
		t.Errorf("denials of two seconds share id %s", e1.ID)
	}
	if e1.ID == e4.ID {
		t.Errorf("denials of two origins share id %s", e1.ID)
	}
	if !e1.Time.Equal(testNow) {
		t.Errorf("NewDenied time = %v, want the start of the second %v", e1.Time, testNow)
	}
}

func TestSubjects(t *testing.T) {
	want := map[string]string{
		TypeReserved: "qf.usage.reserved", TypeDenied: "qf.usage.denied", TypeActual: "qf.usage.actual",
		TypeReleased: "qf.usage.released", TypeCorrected: "qf.usage.corrected", TypeTopUp: "qf.usage.topup",
		"bogus": "",
	}
	for typ, w := range want {
		if got := Subject("qf", typ); got != w {
			t.Errorf("Subject(qf, %s) = %q, want %q", typ, got, w)
		}
	}
	for reason, w := range map[string]string{
		"invalid": "qf.dlq.invalid", "max_deliver": "qf.dlq.max_deliver", "": "qf.dlq.unknown",
		"a.b *>c": "qf.dlq.a_b___c", "zürich": "qf.dlq.z__rich",
	} {
		if got := DLQSubject("qf", reason); got != w {
			t.Errorf("DLQSubject(qf, %q) = %q, want %q", reason, got, w)
		}
	}
	if got := UsageSubjects("qf"); got != "qf.usage.>" {
		t.Errorf("UsageSubjects(qf) = %q, want qf.usage.>", got)
	}
	if got := DLQSubjects("qf"); got != "qf.dlq.>" {
		t.Errorf("DLQSubjects(qf) = %q, want qf.dlq.>", got)
	}
}

func TestUnmarshalArray(t *testing.T) {
	var evs []Event
	var parts []string
	for _, ev := range examples() {
		b, err := Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, string(b))
	}
	if err := json.Unmarshal([]byte("["+strings.Join(parts, ",")+"]"), &evs); err != nil {
		t.Fatalf("json.Unmarshal([]Event) = %v", err)
	}
	if !reflect.DeepEqual(evs, examples()) {
		t.Errorf("json.Unmarshal([]Event) = %+v, want the examples", evs)
	}
	bad := `[` + parts[0] + `,{"specversion":"1.0"}]`
	if err := json.Unmarshal([]byte(bad), &evs); !errors.Is(err, ErrInvalid) {
		t.Errorf("json.Unmarshal(array with a bad event) = %v, want ErrInvalid", err)
	}
}

// AppendEncode appends exactly what Encode returns, for every type and for
// an event encoding/json writes (an escaped string), and leaves dst as it
// was when the event is invalid or too large.
func TestAppendEncode(t *testing.T) {
	escaped := examples()[0]
	r := escaped.Data.(Reserved)
	r.User = "u\"1"
	escaped.Data = r
	prefix := []byte("[prefix,")
	for _, ev := range append(examples(), escaped) {
		want, err := Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		got, err := AppendEncode(bytes.Clone(prefix), ev)
		if err != nil || !bytes.Equal(got, append(bytes.Clone(prefix), want...)) {
			t.Errorf("AppendEncode(prefix, %s) = %q, %v; want the prefix and %q", ev.Type(), got, err, want)
		}
	}
	huge := examples()[0] // valid, but with 600 limits of long names
	r = huge.Data.(Reserved)
	r.Limits = make([]LimitState, 600)
	for i := range r.Limits {
		r.Limits[i] = LimitState{Scope: "user", Name: strings.Repeat("n", 100), Unit: "tokens", Limit: 1}
	}
	huge.Data = r
	for name, ev := range map[string]Event{"invalid": {ID: "x"}, "too large": huge} {
		got, err := AppendEncode(prefix, ev)
		if !errors.Is(err, ErrInvalid) || !bytes.Equal(got, prefix) || name == "too large" && !strings.Contains(err.Error(), "larger than") {
			t.Errorf("AppendEncode(prefix, %s) = %q, %v; want the prefix as it was and ErrInvalid", name, got, err)
		}
	}
}
