package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"quotaflow/pkg/ident"
)

// FuzzDecode checks that Decode never panics, that every error wraps
// ErrInvalid, and that whatever it accepts is valid, holds only valid
// identifiers (ident.Check, asserted apart from the checker) and survives
// Encode/Decode unchanged. Seeds: testdata/fuzz/FuzzDecode (one valid event
// of each type and broken ones) and the examples.
func FuzzDecode(f *testing.F) {
	for _, ev := range examples() {
		b, err := Encode(ev)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Decode(%q) = %v, does not wrap ErrInvalid", b, err)
			}
			if !reflect.DeepEqual(ev, Event{}) {
				t.Fatalf("Decode(%q) returned %+v with an error", b, ev)
			}
			return
		}
		if err := ev.Validate(); err != nil {
			t.Fatalf("Decode(%q) accepted an event Validate rejects: %v", b, err)
		}
		checkIdentifiers(t, ev)
		agreeWithStdlib(t, b, ev)
		b2, err := Encode(ev)
		if err != nil {
			// Re-encoding may grow (e.g. U+2028 is escaped); only size
			// may fail.
			if errors.Is(err, ErrInvalid) && strings.Contains(err.Error(), "larger than") {
				return
			}
			t.Fatalf("Encode(Decode(%q)) = %v", b, err)
		}
		ev2, err := Decode(b2)
		if err != nil {
			t.Fatalf("Decode(Encode(Decode(%q))) = %v", b, err)
		}
		if !reflect.DeepEqual(ev, ev2) {
			t.Fatalf("round trip changed the event:\n%+v\n%+v", ev, ev2)
		}
		b3, err := Encode(ev2)
		if err != nil || !bytes.Equal(b2, b3) {
			t.Fatalf("Encode is not stable: %s vs %s (%v)", b2, b3, err)
		}
	})
}

// checkIdentifiers fails unless every string of an accepted event (source,
// and every string in data, nested ones included: identifiers, scopes,
// units, times) passes ident.Check. It walks the JSON encoding/json makes
// of the data, so it needs no list of fields that could fall behind.
func checkIdentifiers(t *testing.T, ev Event) {
	t.Helper()
	b, err := json.Marshal(ev.Data)
	if err != nil {
		t.Fatal(err)
	}
	var data any
	if err := json.Unmarshal(b, &data); err != nil {
		t.Fatal(err)
	}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case string:
			if err := ident.Check(v); err != nil {
				t.Fatalf("accepted %s %q: %v", path, v, err)
			}
		case map[string]any:
			for k, x := range v {
				walk(path+"."+k, x)
			}
		case []any:
			for i, x := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), x)
			}
		}
	}
	walk("source", ev.Source)
	walk("data", data)
}

// agreeWithStdlib checks Decode's hand-written scanner against
// encoding/json: the envelope strings and every scalar data field must read
// the same.
func agreeWithStdlib(t *testing.T, b []byte, ev Event) {
	var in struct {
		ID     string         `json:"id"`
		Source string         `json:"source"`
		Type   string         `json:"type"`
		Data   map[string]any `json:"data"`
	}
	if err := json.Unmarshal(b, &in); err != nil {
		t.Fatalf("Decode accepted %q, encoding/json says %v", b, err)
	}
	if in.ID != ev.ID || in.Source != ev.Source || in.Type != ev.Type() {
		t.Fatalf("envelope of %q: encoding/json reads %q %q %q, Decode %q %q %q",
			b, in.ID, in.Source, in.Type, ev.ID, ev.Source, ev.Type())
	}
	ours, err := json.Marshal(ev.Data)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(ours, &out); err != nil {
		t.Fatal(err)
	}
	for k, v := range out {
		switch v.(type) {
		case string, float64:
			if k != "expires_at" && in.Data[k] != v {
				t.Fatalf("data.%s of %q: encoding/json reads %v, Decode %v", k, b, in.Data[k], v)
			}
		}
	}
}
