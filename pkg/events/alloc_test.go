//go:build !race

package events

import "testing"

// Decoding takes its scratch (member arena, checker state, data reader)
// from a pool: an actual event, as POST /v1/usage receives it, costs its
// strings, payload and boxing only (12 allocations and ~2.2 kB with a new
// arena each; 11 and ~0.4 kB with the arena pooled; 8 and ~0.2 kB with the
// whole scratch). The race detector's instrumentation allocates on its own.
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
	}); n > 8 {
		t.Errorf("DecodeReported(actual) allocates %v times, want at most 8 (no scratch)", n)
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

// A batch of one event (POST /v1/usage's usual body) costs the event's
// decode and the batch's three slices (events, errors, raw elements): no
// map of shared names, which only events after the first could use.
func TestDecodeBatchOfOne(t *testing.T) {
	var b []byte
	for _, e := range examples() {
		if e.Type() == TypeActual {
			b, _ = Encode(e)
		}
	}
	batch := append(append([]byte{'['}, b...), ']')
	alone := testing.AllocsPerRun(100, func() {
		if _, err := DecodeReported(b); err != nil {
			t.Fatal(err)
		}
	})
	inBatch := testing.AllocsPerRun(100, func() {
		if _, errs, err := DecodeReportedBatch(batch); err != nil || errs[0] != nil {
			t.Fatal(err, errs)
		}
	})
	if inBatch > alone+3 {
		t.Errorf("DecodeReportedBatch of one event allocates %v times, its event alone %v: want at most 3 more", inBatch, alone)
	}
}
