// Package authtest holds what the tests of admission's API tokens share:
// the tokens file's sha256 form of a token, and the check that a log or an
// error gives away no token. It imports nothing of auth, so auth's own
// tests can use it.
package authtest

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
)

// SHA256Hex is the hex SHA-256 of tok, as a tokens file's sha256 field
// holds it.
func SHA256Hex(tok string) string {
	s := sha256.Sum256([]byte(tok))
	return hex.EncodeToString(s[:])
}

// NoSecrets fails the test when s (what where names: "the logs", an
// error) holds one of the tokens or the start of its digest.
func NoSecrets(t testing.TB, where, s string, tokens ...string) {
	t.Helper()
	for _, tok := range tokens {
		if strings.Contains(s, tok) || strings.Contains(strings.ToLower(s), SHA256Hex(tok)[:16]) {
			t.Errorf("%s holds the token %q or its digest: %s", where, tok, s)
		}
	}
}
