package httpapi

import (
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkAdmitHandler measures the HTTP layer alone (decode, validate,
// headers, body, event hand-off) around a decider that answers at once.
func BenchmarkAdmitHandler(b *testing.B) {
	e := newEnv(b, nil)
	e.dec.admit = allowed
	e.ev.enqueued = nil
	body := admitBodyOK
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest("POST", "/v1/admit", strings.NewReader(body))
		w := httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		if w.Code != 200 {
			b.Fatalf("code %d", w.Code)
		}
		e.ev.mu.Lock()
		e.ev.enqueued = e.ev.enqueued[:0]
		e.ev.mu.Unlock()
		e.dec.mu.Lock()
		e.dec.inputs = e.dec.inputs[:0]
		e.dec.mu.Unlock()
	}
}
