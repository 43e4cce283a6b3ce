package gotool

import (
	"os"
	"path/filepath"
	"testing"
)

// While the binary is being written, its path does not exist yet: a
// concurrent caller builds too instead of executing half a file; once
// written, the whole file is there and the temporary directory is gone.
func TestInstalledAppearsWhole(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "cache", "service_cmd")
	whole := []byte("#!/bin/sh\nexit 0\n")
	got, err := installed(bin, func(gobin string) error {
		f, err := os.OpenFile(filepath.Join(gobin, "service_cmd"), os.O_CREATE|os.O_WRONLY, 0o755)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := f.Write(whole[:5]); err != nil {
			return err
		}
		if _, err := os.Stat(bin); !os.IsNotExist(err) {
			t.Errorf("half-written: stat %s = %v, want not exist", bin, err)
		}
		_, err = f.Write(whole[5:])
		return err
	})
	if err != nil || got != bin {
		t.Fatalf("installed = %q, %v; want %q", got, err, bin)
	}
	if b, err := os.ReadFile(bin); err != nil || string(b) != string(whole) {
		t.Errorf("installed file = %q, %v; want %q", b, err, whole)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "cache", ".install-*")); len(left) != 0 {
		t.Errorf("temporary directories left: %v", left)
	}
	// Present: install is not called again.
	if _, err := installed(bin, func(string) error { t.Error("installed again"); return nil }); err != nil {
		t.Error(err)
	}
}
