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

// BenchmarkUsageHandler measures POST /v1/usage's HTTP layer alone
// (decode, validate, id derivation, answer) with the body the pipeline
// bench sends: one actual event, handed to a sink that stores at once.
func BenchmarkUsageHandler(b *testing.B) {
	e := newEnv(b, nil)
	body := "[" + actualJSON("e1", "bench", 40) + "]"
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest("POST", "/v1/usage", strings.NewReader(body))
		w := httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		if w.Code != 202 {
			b.Fatalf("code %d %s", w.Code, w.Body)
		}
		e.ev.mu.Lock()
		e.ev.now = e.ev.now[:0]
		e.ev.mu.Unlock()
	}
}
