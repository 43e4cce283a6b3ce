package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/internal/e2e"
)

// TestUsageRetriesUnavailable: admission answers GET /v1/usage with 503
// and Retry-After when its Redis read fails (a timeout on a loaded host);
// the check asks again within its settle time instead of failing "Redis
// windows equal the ledger", and gives up only when the 503s outlast it.
func TestUsageRetriesUnavailable(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failures int64 // 503s before the 200
		settle   time.Duration
		wantErr  bool
	}{
		{"answers at once", 0, time.Minute, false},
		{"answers after a 503", 1, time.Minute, false},
		{"503s outlast the settle time", 1 << 30, 500 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v1/usage" || r.Header.Get("Authorization") != "Bearer tok" {
					http.Error(w, "unexpected request", http.StatusBadRequest)
					return
				}
				if calls.Add(1) <= tc.failures {
					w.Header().Set("Retry-After", "1")
					http.Error(w, "usage: temporarily unavailable, retry", http.StatusServiceUnavailable)
					return
				}
				w.Write([]byte(`{"limits":[{"name":"5h","unit":"tokens","used":42}]}`))
			}))
			defer srv.Close()
			st := &stack{Private: &e2e.Private{API: srv.URL}, token: "tok"}
			lims, err := st.usage(context.Background(), "t", "u", time.Now().Add(tc.settle))
			if tc.wantErr {
				if err == nil {
					t.Fatalf("usage = %v after %d calls, want an error", lims, calls.Load())
				}
				return
			}
			if err != nil || len(lims) != 1 || lims[0].Used != 42 {
				t.Fatalf("usage = %v, %v after %d calls, want 5h used 42", lims, err, calls.Load())
			}
		})
	}
}
