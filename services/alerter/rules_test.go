package main

import (
	"os/exec"
	"testing"

	"quotaflow/internal/e2e"
)

// TestPrometheusRules checks deploy/prometheus/rules.yml with promtool
// (Debian package prometheus) and runs its unit tests (rules_test.yml:
// the denial-rate rule fires above 5% and only with enough traffic),
// installing promtool when missing (e2e.EnsureTool: skipped only outside CI
// where it cannot be installed).
func TestPrometheusRules(t *testing.T) {
	promtool := e2e.EnsureTool(t, "promtool")
	out, err := exec.Command(promtool, "check", "rules", "../../deploy/prometheus/rules.yml").CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	out, err = exec.Command(promtool, "test", "rules", "../../deploy/prometheus/rules_test.yml").CombinedOutput()
	if err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}
