//go:build !race

package httpapi

import "testing"

// A typical body decodes with one allocation, its estimate's (it was 4:
// the strings share the body's memory instead of a copy of it, an IP
// already canonical is kept instead of printed again, and the decoded
// struct stays on the stack unless encoding/json decodes it). The race
// detector's instrumentation allocates on its own.
func TestDecodeAdmitAllocs(t *testing.T) {
	body := []byte(admitBodyOK)
	cost := func(string, int64, int64) int64 { return 0 }
	if n := testing.AllocsPerRun(100, func() {
		if _, ferr := decodeAdmit(body, cost); ferr != nil {
			t.Fatal(ferr)
		}
	}); n > 1 {
		t.Errorf("decodeAdmit(%s) allocates %v times, want 1 (the estimate)", body, n)
	}
}
