package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLinksNoPostgres: admission keeps no table, and Postgres's driver and
// migration engine linked in cost it resident memory (their package
// initialisers touch their pages), so nothing it imports may pull them in.
func TestLinksNoPostgres(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if strings.HasPrefix(pkg, "github.com/jackc/") {
			t.Errorf("admission links %s", pkg)
		}
	}
}
