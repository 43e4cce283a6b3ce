package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// EnsureTool returns the path of a binary the tests run from a Debian
// package: nginx, caddy or promtool (package prometheus), installing it
// with deploy/gateways/ensure.sh when it is missing (its system service is
// never left running). It skips the test only when that is impossible here
// (no apt-get, or no root), and never in CI (CI set), where deps installs
// all three first.
func EnsureTool(t testing.TB, name string) string {
	t.Helper()
	root, err := ModuleRoot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("bash", filepath.Join(root, "deploy", "gateways", "ensure.sh"), name).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 3 && os.Getenv("CI") == "" {
		t.Skipf("%s is not installed and cannot be installed here: %s", name, ee.Stderr)
	}
	if err != nil {
		stderr := ""
		if ee != nil {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("deploy/gateways/ensure.sh %s: %v\n%s", name, err, stderr)
	}
	return strings.TrimSpace(string(out))
}
