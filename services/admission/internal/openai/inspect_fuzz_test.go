package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"
)

// FuzzInspect checks Inspect on arbitrary bodies of every kind: it never
// panics; it fails only with ErrInvalid (a FieldError) or ErrTooLarge, in
// a short message; what
// it accepts it returns as valid JSON whose fields are the client's plus
// the ones it sets, with non-negative counts and one value in every maximum field; and inspecting its own
// output changes nothing more. Seeds live in testdata/fuzz/FuzzInspect.
func FuzzInspect(f *testing.F) {
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		k := Kind(kind%4 + 1)
		r, err := Inspect(k, body, Options{MaxBody: 1 << 16})
		if err != nil {
			var fe *FieldError
			if !errors.Is(err, ErrTooLarge) && (!errors.As(err, &fe) || fe.Field == "") {
				t.Fatalf("Inspect(%v, %q) = %v, want a FieldError or ErrTooLarge", k, body, err)
			}
			if len(err.Error()) > 200 {
				t.Fatalf("Inspect(%v, %q) error is %d bytes long: %v", k, body, len(err.Error()), err)
			}
			return
		}
		if r.InputTokens < 0 || r.OutputTokens < 0 || (k != Embeddings) != (r.OutputTokens > 0) {
			t.Fatalf("Inspect(%v, %q) counts %d in, %d out", k, body, r.InputTokens, r.OutputTokens)
		}
		var before, after map[string]json.RawMessage
		if err := json.Unmarshal(body, &before); err != nil {
			t.Fatalf("Inspect accepted %q, which does not decode: %v", body, err)
		}
		if err := json.Unmarshal(r.Body, &after); err != nil {
			t.Fatalf("Inspect(%q) body %q does not decode: %v", body, r.Body, err)
		}
		for key, v := range before {
			switch key {
			case "max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "stream_options":
				continue
			}
			if !bytes.Equal(after[key], v) {
				t.Fatalf("Inspect(%q) changed %s to %s", body, key, after[key])
			}
		}
		// Every maximum field the upstream may read carries the one maximum.
		var cap json.RawMessage
		for _, key := range maxFields {
			if v, ok := after[key]; ok && k != Embeddings {
				if cap != nil && !bytes.Equal(v, cap) {
					t.Fatalf("Inspect(%q) body %q sets the maximum fields apart", body, r.Body)
				}
				cap = v
			}
		}
		again, err := Inspect(k, r.Body, Options{MaxBody: 1 << 17})
		if err != nil || !bytes.Equal(again.Body, r.Body) || again.InputTokens != r.InputTokens || again.OutputTokens != r.OutputTokens {
			t.Fatalf("Inspect(Inspect(%q).Body) = %+v, %v; want the same body and counts", body, again, err)
		}
	})
}
