//go:build !race

package events

import "testing"

// Decoding takes its member arena from a pool: an actual event, as POST
// /v1/usage receives it, costs its strings, payload and checker only (12
// allocations and ~2.2 kB with a new arena each; 11 and ~0.4 kB now). The
// race detector's instrumentation allocates on its own.
func TestDecodeReusesArena(t *testing.T) {
	var b []byte
	for _, e := range examples() {
		if e.Type() == TypeActual {
			b, _ = Encode(e)
		}
	}
	first, err := DecodeReported(b)
	if err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() {
		if _, err := DecodeReported(b); err != nil {
			t.Fatal(err)
		}
	}); n > 11 {
		t.Errorf("DecodeReported(actual) allocates %v times, want at most 11 (no arena)", n)
	}
	// What a decode returns shares nothing with the arena the next reuses.
	for _, e := range examples() {
		enc, _ := Encode(e)
		_, _ = Decode(enc)
	}
	if again, _ := DecodeReported(b); again.Data != first.Data || again.Time != first.Time {
		t.Errorf("a decoded event changed after later decodes: %+v, then %+v", first, again)
	}
}
