package main

import (
	"os/exec"
	"testing"
)

// TestPrometheusRules checks deploy/prometheus/rules.yml with promtool
// (Debian package prometheus) and runs its unit tests (rules_test.yml:
// the denial-rate rule fires above 5% and only with enough traffic); it is
// skipped where promtool is absent.
func TestPrometheusRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not on PATH (install the Debian package prometheus): rules.yml not checked")
	}
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
