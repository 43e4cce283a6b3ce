package deploytest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestEnsureWarnsOfPrometheus: where promtool is already installed and the
// packaged prometheus.service runs (holding :9090, admission's default ops
// port), gateways/ensure.sh still prints promtool's path, and warns clearly
// on stderr; with the service stopped it says nothing. systemctl and
// promtool are stand-ins on PATH: the test changes nothing on the machine.
func TestEnsureWarnsOfPrometheus(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	for _, tc := range []struct {
		name   string
		active bool
	}{{"running", true}, {"stopped", false}} {
		t.Run(tc.name, func(t *testing.T) {
			bin := t.TempDir()
			status := "3" // systemctl is-active: inactive
			if tc.active {
				status = "0"
			}
			for name, script := range map[string]string{
				"promtool": "#!/bin/sh\nexit 0\n",
				// Active only when asked about prometheus.service.
				"systemctl": "#!/bin/sh\n[ \"$1 $2 $3\" = \"is-active --quiet prometheus.service\" ] && exit " + status + "\nexit 1\n",
			} {
				if err := os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(bash, filepath.Join(repoRoot, "deploy", "gateways", "ensure.sh"), "promtool")
			cmd.Env = []string{"PATH=" + bin}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("ensure.sh promtool: %v\n%s", err, stderr.String())
			}
			if got, want := strings.TrimSpace(stdout.String()), filepath.Join(bin, "promtool"); got != want {
				t.Errorf("stdout = %q, want promtool's path %q", got, want)
			}
			warned := strings.Contains(stderr.String(), "WARNING: prometheus.service is running and holds :9090, admission's default ops port")
			if warned != tc.active {
				t.Errorf("prometheus.service active %v: stderr = %q, want a warning %v", tc.active, stderr.String(), tc.active)
			}
		})
	}
}
