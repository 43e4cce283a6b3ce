package main

import (
	"strings"
	"testing"
)

// -peer, -rls and -scale refuse the flags they would ignore, naming them; the
// flags they use pass.
func TestCheckMode(t *testing.T) {
	for _, c := range []struct {
		set       []string
		peer, rls bool
		scale     bool
		bad       string // "": accepted
	}{
		{set: []string{"redis-timeout", "ab-env", "down"}},
		{set: []string{"rls", "ab", "redis-timeout"}, rls: true, bad: "-rls does not use -redis-timeout"},
		{set: []string{"rls", "ab", "ab-env"}, rls: true},
		{set: []string{"peer", "ab-env"}, peer: true, bad: "-peer does not use -ab-env"},
		{set: []string{"rls", "ab", "grpc-conns", "rls-client", "rounds", "envoy-pool"}, rls: true},
		{set: []string{"peer", "grpc-conns", "rls-client"}, peer: true, bad: "-peer does not use -grpc-conns, -rls-client"},
		{set: []string{"rls", "targets", "open"}, rls: true, bad: "-rls does not use -targets, -open"},
		{set: []string{"rls", "open-conns"}, rls: true, bad: "-rls does not use -open-conns"},
		{set: []string{"peer", "open", "open-conns"}, peer: true},
		{set: []string{"peer", "ab"}, peer: true, bad: "-peer does not use -ab"},
		{set: []string{"peer", "peer-base", "targets", "open"}, peer: true},
		{set: []string{"peer", "profile", "heapprofile"}, peer: true, bad: "-peer does not use -profile, -heapprofile"},
		{set: []string{"scale", "duration", "concurrency", "users", "rounds"}, scale: true},
		{set: []string{"scale", "rounds", "peer", "open"}, scale: true, bad: "-scale does not use -peer, -open"},
		{set: []string{"scale", "hot", "rounds"}, scale: true},
		{set: []string{"hot", "duration"}, bad: "-hot is a shape of -scale"},
	} {
		err := checkMode(c.set, c.peer, c.rls, c.scale)
		if c.bad == "" && err != nil || c.bad != "" && (err == nil || !strings.Contains(err.Error(), c.bad)) {
			t.Errorf("checkMode(%v, peer %v, rls %v, scale %v) = %v, want %q", c.set, c.peer, c.rls, c.scale, err, c.bad)
		}
	}
}
