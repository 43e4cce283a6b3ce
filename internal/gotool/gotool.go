// Package gotool builds a Go command at a pinned module version once into
// the user's cache directory (~/.cache/quotaflow-bench/<name>@<version>/)
// with `go install` through the module proxy, for the tests and benchmarks
// that run a real peer or client: envoyproxy/ratelimit's service_cmd, ghz.
package gotool

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Binary returns the path of pkg (a main package) built at version,
// building it the first time; name keys its cache directory and took says
// how long a first build takes, for the note printed meanwhile.
func Binary(name, pkg, version, took string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "quotaflow-bench", name+"@"+version)
	return installed(filepath.Join(dir, filepath.Base(pkg)), func(gobin string) error {
		fmt.Fprintf(os.Stderr, "building %s@%s into %s (%s the first time)\n", pkg, version, dir, took)
		cmd := exec.Command("go", "install", pkg+"@"+version)
		cmd.Env = append(os.Environ(), "GOBIN="+gobin)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go install %s@%s: %v\n%s", pkg, version, err, out)
		}
		return nil
	})
}

// installed returns bin, first installing it when absent: install writes
// it into an empty temporary directory beside bin, and the whole file is
// renamed into place, so a concurrent caller (the differential test and a
// benchmark) never execs a half-written binary.
func installed(bin string, install func(gobin string) error) (string, error) {
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(bin), ".install-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := install(tmp); err != nil {
		return "", err
	}
	if err := os.Rename(filepath.Join(tmp, filepath.Base(bin)), bin); err != nil {
		return "", err
	}
	return bin, nil
}
