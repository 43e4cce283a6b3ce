//go:build !race

package httpapi

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

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

// The duration metric's wrapper costs a request no allocation (it was one:
// a statusWriter a request).
func TestInstrumentAllocs(t *testing.T) {
	h := &Handler{log: slog.New(slog.DiscardHandler), duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "d"}, []string{"route", "code"})}
	next := h.instrument("r", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	w, r := &codeWriter{}, httptest.NewRequest("GET", "/", nil)
	if n := testing.AllocsPerRun(100, func() { next.ServeHTTP(w, r) }); n > 0 {
		t.Errorf("instrument's wrapper allocates %v times a request, want 0", n)
	}
	if w.code != http.StatusNoContent {
		t.Errorf("the handler's status reached the writer as %d, want 204", w.code)
	}
}

// codeWriter is a ResponseWriter that only records the status code.
type codeWriter struct{ code int }

func (c *codeWriter) Header() http.Header         { return nil }
func (c *codeWriter) Write(b []byte) (int, error) { return len(b), nil }
func (c *codeWriter) WriteHeader(code int)        { c.code = code }
