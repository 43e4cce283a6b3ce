package auth

import (
	"crypto/sha256"
	"regexp"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"quotaflow/pkg/ident"
)

// entryMessages are every error ParseEntry may return, with a role's
// position written N: a closed set, so no error can carry any part of an
// entry.
var entryMessages = map[string]bool{
	"empty token": true,
	"token contains white space or a control character": true,
	"empty tenant after '@'":                            true,
	"tenant " + ident.ErrTooLong.Error():                true,
	"tenant " + ident.ErrInvalidUTF8.Error():            true,
	"tenant " + ident.ErrControl.Error():                true,
	"no role after '#'":                                 true,
	"role N after '#' is empty or unknown (want gateway, report, billing or admin, joined with '+')": true,
	"role admin acts for every tenant and cannot be bound to one":                                    true,
}

var rolePosition = regexp.MustCompile(`^role [0-9]+ after`)

// FuzzParseEntry checks the QF_API_TOKENS entry parser on arbitrary
// entries: it never panics; every error is one of its fixed messages (so it
// never repeats a token, a tenant or a role); what it accepts follows the
// grammar token[@tenant][#role+role] with every rule of docs/design.md §4 and
// survives a round trip. Seeds live in testdata/fuzz/FuzzParseEntry.
func FuzzParseEntry(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		e, err := ParseEntry(s)
		if err != nil {
			if msg := rolePosition.ReplaceAllString(err.Error(), "role N after"); !entryMessages[msg] {
				t.Fatalf("ParseEntry(%q) error %q is not one of the fixed messages", s, err)
			}
			return
		}
		tok, rest := s, ""
		if i := strings.IndexAny(s, "@#"); i >= 0 {
			tok, rest = s[:i], s[i:]
		}
		if tok == "" || strings.ContainsFunc(tok, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) {
			t.Fatalf("ParseEntry(%q) accepted the token %q", s, tok)
		}
		if e.digest != sha256.Sum256([]byte(tok)) {
			t.Fatalf("ParseEntry(%q): the digest is not the token's %q", s, tok)
		}
		wantTenant := ""
		if after, ok := strings.CutPrefix(rest, "@"); ok {
			wantTenant, _, _ = strings.Cut(after, "#")
		}
		if e.Tenant != wantTenant || len(e.Tenant) > ident.MaxLen || !utf8.ValidString(e.Tenant) ||
			strings.ContainsFunc(e.Tenant, unicode.IsControl) {
			t.Fatalf("ParseEntry(%q) tenant = %q, want %q, a valid identifier", s, e.Tenant, wantTenant)
		}
		switch {
		case e.Roles == 0 || e.Roles&^(Gateway|Report|Billing|Admin) != 0:
			t.Fatalf("ParseEntry(%q) roles = %b", s, e.Roles)
		case !strings.Contains(rest, "#") && e.Roles != DefaultRoles:
			t.Fatalf("ParseEntry(%q) without roles = %v, want %v", s, e.Roles, DefaultRoles)
		case e.Roles&Admin != 0 && e.Tenant != "":
			t.Fatalf("ParseEntry(%q) bound an admin to %q", s, e.Tenant)
		}
		// Round trip: the entry written out again parses to the same entry.
		again := tok
		if e.Tenant != "" {
			again += "@" + e.Tenant
		}
		again += "#" + e.Roles.String()
		if e2, err := ParseEntry(again); err != nil || e2 != e {
			t.Fatalf("round trip of %q through %q: %v, %v; want %v", s, again, e2, err, e)
		}
	})
}
