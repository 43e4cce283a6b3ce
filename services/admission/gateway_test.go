package main

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Helpers of the tests that run real gateways (nginx_test.go,
// caddy_test.go) in front of admission.

// ensureGateway returns the binary of gateway (nginx or caddy), installing
// its Debian package with deploy/gateways/ensure.sh when it is missing. It
// skips the test only when that is impossible here (no apt-get, or no
// root), and never in CI, where deps installs both gateways first.
func ensureGateway(t *testing.T, gateway string) string {
	t.Helper()
	out, err := exec.Command("bash", filepath.Join("..", "..", "deploy", "gateways", "ensure.sh"), gateway).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 3 && os.Getenv("CI") == "" {
		t.Skipf("%s is not installed and cannot be installed here: %s", gateway, ee.Stderr)
	}
	if err != nil {
		stderr := ""
		if ee != nil {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("deploy/gateways/ensure.sh %s: %v\n%s", gateway, err, stderr)
	}
	return strings.TrimSpace(string(out))
}

// gatewayConfig is the file deploy/gateways/<name> with each key of repl
// replaced by its value; it fails the test when a key is no longer in the
// file, so the test keeps running the file as shipped.
func gatewayConfig(t *testing.T, name string, repl map[string]string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "gateways", name))
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	for old, new := range repl {
		if !strings.Contains(text, old) {
			t.Fatalf("deploy/gateways/%s no longer contains %q", name, old)
		}
		text = strings.ReplaceAll(text, old, new)
	}
	return text
}

// waitListening waits until something accepts connections on addr.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
