package auth

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/auth/authtest"
)

// save writes content to path the way editors and kubelet do: a new file
// renamed over the old one, so a reader never sees it half-written.
func save(t *testing.T, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// fileAuth is an Auth on a tokens file holding content, with
// QF_API_TOKENS env, whose reload verdicts arrive on the returned channel.
func fileAuth(t *testing.T, content string, env ...string) (*Auth, string, <-chan error, *bytes.Buffer) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokens.yaml")
	save(t, path, content)
	logs := &bytes.Buffer{} // Reload logs on the caller's goroutine: no lock needed
	verdicts := make(chan error, 100)
	a, err := New(Options{
		Tokens: env, File: path, Debounce: 10 * time.Millisecond,
		Log:      slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		OnReload: func(err error) { verdicts <- err },
	})
	if err != nil {
		t.Fatalf("New = %v", err)
	}
	return a, path, verdicts, logs
}

func valid(a *Auth, tok string) bool {
	_, ok := a.Authenticate(request("Bearer " + tok))
	return ok
}

func TestNewStart(t *testing.T) {
	if a, err := New(Options{Tokens: []string{" ", ""}}); a != nil || err != nil {
		t.Errorf("New without tokens or file = %v, %v; want nil, nil (no authentication)", a, err)
	}
	if a, err := New(Options{Tokens: []string{"s3cret@"}}); a != nil || err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("New with a bad entry = %v, %v; want an error without the token", a, err)
	}

	dir := t.TempDir()
	if _, err := New(Options{File: filepath.Join(dir, "missing.yaml")}); err == nil || !strings.Contains(err.Error(), "QF_API_TOKENS_FILE") {
		t.Errorf("New with a missing file = %v, want an error naming QF_API_TOKENS_FILE", err)
	}
	bad := filepath.Join(dir, "bad.yaml")
	save(t, bad, "- {token: s3cret-start, roles: [root]}\n")
	_, err := New(Options{File: bad})
	if err == nil || !strings.Contains(err.Error(), "QF_API_TOKENS_FILE "+bad+": [0].roles[0]: unknown role") {
		t.Errorf("New with an invalid file = %v, want the file and the path of the mistake", err)
	}
	authtest.NoSecrets(t, "New's error", err.Error(), "s3cret-start")

	// A file with no tokens yet is authentication with no token in force.
	empty := filepath.Join(dir, "none.yaml")
	save(t, empty, "[]\n")
	a, err := New(Options{File: empty})
	if err != nil || a == nil || a.Len() != 0 || valid(a, "anything") {
		t.Errorf("New with [] = %v, %v; want an Auth that accepts no token", a, err)
	}
}

func TestReload(t *testing.T) {
	a, path, verdicts, logs := fileAuth(t, "- {token: s3cret-old, tenant: acme}\n", "s3cret-env#report")
	if !valid(a, "s3cret-old") || !valid(a, "s3cret-env") || a.Len() != 2 {
		t.Fatalf("at start: old %v, env %v, %d tokens; want both valid", valid(a, "s3cret-old"), valid(a, "s3cret-env"), a.Len())
	}
	if len(verdicts) != 0 {
		t.Error("the first load called OnReload")
	}

	// Rotation: the new token, given by its digest, replaces the old one;
	// QF_API_TOKENS stays.
	save(t, path, "- {sha256: "+authtest.SHA256Hex("s3cret-new")+", tenant: acme}\n")
	if err := a.Reload(); err != nil {
		t.Fatalf("Reload = %v", err)
	}
	if err := <-verdicts; err != nil {
		t.Errorf("OnReload(%v), want nil", err)
	}
	if valid(a, "s3cret-old") || !valid(a, "s3cret-new") || !valid(a, "s3cret-env") {
		t.Errorf("after rotating: old %v, new %v, env %v; want false, true, true",
			valid(a, "s3cret-old"), valid(a, "s3cret-new"), valid(a, "s3cret-env"))
	}

	// An invalid edit is rejected: the last good tokens stay.
	save(t, path, "- {token: s3cret-broken, tenat: acme}\n")
	err := a.Reload()
	if err == nil || !strings.Contains(err.Error(), "[0]: unknown field on line 1") {
		t.Fatalf("Reload of an invalid file = %v, want the path of the mistake", err)
	}
	authtest.NoSecrets(t, "Reload's error", err.Error(), "s3cret-broken", "s3cret-new", "s3cret-env")
	if got := <-verdicts; got == nil {
		t.Error("OnReload(nil) for an invalid file")
	}
	if !valid(a, "s3cret-new") || valid(a, "s3cret-broken") {
		t.Error("an invalid edit changed the tokens in force")
	}
	// The same broken content again: the same verdict, not counted twice.
	if err2 := a.Reload(); err2 == nil || err2.Error() != err.Error() || len(verdicts) != 0 {
		t.Errorf("second Reload of the same content = %v (%d verdicts), want the same error and no verdict", err2, len(verdicts))
	}
	// A file missing for a moment mid-rename is no verdict either.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload(); err == nil || len(verdicts) != 0 || !valid(a, "s3cret-new") {
		t.Errorf("Reload of a missing file = %v (%d verdicts), want an error, no verdict, tokens unchanged", err, len(verdicts))
	}
	// A half-written (empty) file revokes nothing.
	save(t, path, "")
	if err := a.Reload(); err == nil || !valid(a, "s3cret-new") {
		t.Errorf("Reload of an empty file = %v, want an error and the tokens unchanged", err)
	}
	authtest.NoSecrets(t, "the logs", logs.String(), "s3cret-old", "s3cret-new", "s3cret-env", "s3cret-broken")
}
