package service_test

import (
	"testing"

	"quotaflow/internal/service"
)

// TestLoopbackUnless: an API without tokens listens on a loopback host only.
func TestLoopbackUnless(t *testing.T) {
	for _, tc := range []struct {
		addr          string
		authenticated bool
		want          string
	}{
		{":8081", true, ":8081"},
		{":8081", false, "127.0.0.1:8081"},
		{"0.0.0.0:8081", false, "127.0.0.1:8081"},
		{"[::]:8081", false, "127.0.0.1:8081"},
		{"192.0.2.7:8081", false, "127.0.0.1:8081"},
		{"127.0.0.1:8081", false, "127.0.0.1:8081"},
		{"[::1]:8081", false, "[::1]:8081"},
		{"localhost:8081", false, "localhost:8081"},
		{"192.0.2.7:8081", true, "192.0.2.7:8081"},
	} {
		if got := service.LoopbackUnless(tc.authenticated, tc.addr); got != tc.want {
			t.Errorf("LoopbackUnless(%v, %q) = %q, want %q", tc.authenticated, tc.addr, got, tc.want)
		}
	}
}
