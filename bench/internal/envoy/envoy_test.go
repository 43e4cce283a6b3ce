package envoy

import (
	"encoding/json"
	"testing"
)

// The check must be the JSON of a RateLimitRequest with one descriptor of
// one entry, user = u<N>: the peer answers 400 to anything else.
func TestBody(t *testing.T) {
	var req struct {
		Domain      string
		Descriptors []struct{ Entries []struct{ Key, Value string } }
	}
	b := Body([]byte("kept"), 42)
	if string(b[:4]) != "kept" {
		t.Fatalf("Body overwrote dst: %q", b)
	}
	if err := json.Unmarshal(b[4:], &req); err != nil {
		t.Fatalf("Body = %s: %v", b[4:], err)
	}
	if req.Domain != "bench" || len(req.Descriptors) != 1 || len(req.Descriptors[0].Entries) != 1 ||
		req.Descriptors[0].Entries[0] != (struct{ Key, Value string }{"user", "u42"}) {
		t.Errorf("Body(42) = %s, want domain bench and one entry user=u42", b[4:])
	}
}
