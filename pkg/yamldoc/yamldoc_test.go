package yamldoc

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

// ReadFile stops one byte past max, so a caller can tell the file is too
// large without reading it all.
func TestReadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f.yaml")
	if err := os.WriteFile(path, make([]byte, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ max, want int64 }{{10, 11}, {99, 100}, {100, 100}, {1000, 100}} {
		if b, err := ReadFile(path, c.max); err != nil || int64(len(b)) != c.want {
			t.Errorf("ReadFile(100 bytes, max %d) = %d bytes, %v; want %d", c.max, len(b), err, c.want)
		}
	}
	if _, err := ReadFile(path+".missing", 10); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadFile(missing) = %v, want fs.ErrNotExist", err)
	}
}
