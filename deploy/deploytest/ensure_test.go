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
// port) or is enabled (it will at the next boot), gateways/ensure.sh still
// prints promtool's path, and warns clearly on stderr; with the service
// stopped and disabled it says nothing. systemctl and promtool are
// stand-ins on PATH: the test changes nothing on the machine.
func TestEnsureWarnsOfPrometheus(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	const running = "WARNING: prometheus.service is running and holds :9090, admission's default ops port"
	const enabled = "WARNING: prometheus.service is stopped but enabled, and at the next boot will hold :9090"
	for _, tc := range []struct {
		name            string
		active, enabled bool
		want            string // "": no warning
	}{
		{"running", true, true, running},
		{"stopped, enabled", false, true, enabled},
		{"stopped, disabled", false, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bin := t.TempDir()
			// systemctl's answers: 0 yes; 3 inactive, 1 disabled.
			active, enabledStatus := "3", "1"
			if tc.active {
				active = "0"
			}
			if tc.enabled {
				enabledStatus = "0"
			}
			for name, script := range map[string]string{
				"promtool": "#!/bin/sh\nexit 0\n",
				// Answers only about prometheus.service.
				"systemctl": "#!/bin/sh\n[ \"$1 $2 $3\" = \"is-active --quiet prometheus.service\" ] && exit " + active +
					"\n[ \"$1 $2 $3\" = \"is-enabled --quiet prometheus.service\" ] && exit " + enabledStatus + "\nexit 1\n",
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
			got := strings.TrimSpace(stderr.String())
			if tc.want == "" && got != "" || tc.want != "" && (!strings.Contains(got, tc.want) || strings.Count(got, "WARNING") != 1) {
				t.Errorf("prometheus.service active %v, enabled %v: stderr = %q, want one warning %q", tc.active, tc.enabled, got, tc.want)
			}
		})
	}
}
