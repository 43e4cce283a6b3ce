package service

import (
	"bytes"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/natstest"
	"quotaflow/internal/obs"
)

// ConnectNATS returns at once while NATS is down, connects when it comes
// up, and the stack closes the connection at Close.
func TestConnectNATSWaitsForTheServerAndDrains(t *testing.T) {
	dir := t.TempDir()
	srv := natstest.Embedded(t, dir, -1)
	port := srv.Addr().(*net.TCPAddr).Port
	natstest.Stop(srv)

	var logs bytes.Buffer
	s := NewStack(slog.New(slog.NewTextHandler(&logs, nil)), 5*time.Second, obs.NewReadiness())
	start := time.Now()
	nc, _, err := ConnectNATS(s, "test", srv.ClientURL())
	if err != nil {
		t.Fatalf("ConnectNATS while NATS is down = %v, want a connection that retries", err)
	}
	if d := time.Since(start); d > time.Second || nc.IsConnected() {
		t.Fatalf("ConnectNATS took %v, connected %v: want it to return at once, not connected", d, nc.IsConnected())
	}

	srv = natstest.Embedded(t, dir, port)
	defer natstest.Stop(srv)
	for deadline := time.Now().Add(10 * time.Second); !nc.IsConnected(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not connected within 10s of NATS coming up")
		}
	}
	s.Close()
	if !nc.IsClosed() {
		t.Error("the connection is open after Close")
	}
	if !strings.Contains(logs.String(), "nats connected") {
		t.Errorf("logs = %s, want the late connect logged", logs.String())
	}
}
