package auth

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

// marker is in every part of the bad entries below that could be (part
// of) a token: an error must not contain it.
const marker = "s3cret"

func TestParseEntry(t *testing.T) {
	for _, tc := range []struct {
		entry, token, tenant string
		roles                Roles
	}{
		{"tok", "tok", "", Gateway | Report},
		{"tok@acme", "tok", "acme", Gateway | Report},
		{"tok#gateway", "tok", "", Gateway},
		{"tok#report+billing", "tok", "", Report | Billing},
		{"tok#billing+billing", "tok", "", Billing},
		{"tok#admin", "tok", "", Admin},
		{"tok@acme#gateway+report+billing", "tok", "acme", Gateway | Report | Billing},
		{"tok@b@c", "tok", "b@c", Gateway | Report}, // the token ends at the first '@'
		{"tok@b@c#report", "tok", "b@c", Report},    // '#' ends the tenant
		{"tok@Ünïcødé corp#gateway", "tok", "Ünïcødé corp", Gateway},
		{"t!$%&*()=~", "t!$%&*()=~", "", Gateway | Report},
		{"tok@" + strings.Repeat("t", 256), "tok", strings.Repeat("t", 256), Gateway | Report},
	} {
		e, err := ParseEntry(tc.entry)
		if err != nil {
			t.Errorf("ParseEntry(%q) error = %v", tc.entry, err)
			continue
		}
		if e.digest != sha256.Sum256([]byte(tc.token)) || e.Tenant != tc.tenant || e.Roles != tc.roles {
			t.Errorf("ParseEntry(%q) = tenant %q roles %v, digest of %q: %v; want tenant %q roles %v",
				tc.entry, e.Tenant, e.Roles, tc.token, e.digest == sha256.Sum256([]byte(tc.token)), tc.tenant, tc.roles)
		}
	}
}

func TestParseEntryErrors(t *testing.T) {
	for _, tc := range []struct{ entry, want string }{
		{"", "empty token"},
		{"@s3cret-acme", "empty token"},
		{"#admin", "empty token"},
		{"s3cret-token@", "empty tenant after '@'"},
		{"s3cret-token@#gateway", "empty tenant after '@'"},
		{"s3cret-token#", "no role after '#'"},
		{"s3cret-token@s3cret-acme#", "no role after '#'"},
		{"s3cret-token#gateway+", "role 2 after '#' is empty or unknown (want gateway, report, billing or admin, joined with '+')"},
		{"s3cret-token#+gateway", "role 1 after '#' is empty or unknown"},
		{"s3cret-token#Gateway", "role 1 after '#' is empty or unknown"},
		{"s3cret-token#gateway,report", "role 1 after '#' is empty or unknown"},
		{"s3cret#s3cret-after-a-hash", "role 1 after '#' is empty or unknown"}, // never quoted: it is half a token
		{"s3cret@s3cret#s3cret", "role 1 after '#' is empty or unknown"},
		{"s3cret token", "token contains white space or a control character"},
		{"s3cret\ttoken", "token contains white space or a control character"},
		{"s3cret\x00token", "token contains white space or a control character"},
		{"s3cret\u00a0token", "token contains white space or a control character"},
		{"s3cret-token@s3cret-ac\x00me", "tenant contains a control character"},
		{"s3cret-token@s3cret-ac\nme", "tenant contains a control character"},
		{"s3cret-token@s3cret-ac\xffme", "tenant not valid UTF-8"},
		{"s3cret-token@s3cret" + strings.Repeat("t", 251), "tenant longer than 256 bytes"},
		{"s3cret-token@s3cret-acme#admin", "role admin acts for every tenant and cannot be bound to one"},
		{"s3cret-token@s3cret-acme#gateway+admin", "role admin acts for every tenant and cannot be bound to one"},
	} {
		_, err := ParseEntry(tc.entry)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseEntry(%q) error = %v, want %q", tc.entry, err, tc.want)
			continue
		}
		if strings.Contains(err.Error(), marker) {
			t.Errorf("ParseEntry(%q) error %q repeats part of the entry", tc.entry, err)
		}
	}
}

func TestParseEntries(t *testing.T) {
	es, err := ParseEntries([]string{" tok-a ", "", "  ", "tok-b@acme#report"})
	if err != nil || len(es) != 2 || es[1].Tenant != "acme" || es[1].Roles != Report {
		t.Fatalf("ParseEntries = %v, %v; want two entries, the second for acme as report", es, err)
	}
	if es, err := ParseEntries(nil); es != nil || err != nil {
		t.Errorf("ParseEntries(nil) = %v, %v; want nil, nil", es, err)
	}
	// Every bad entry is named by its position from 1, never by its token.
	_, err = ParseEntries([]string{"good-token", "secret-one@", "", "secret-two#root"})
	const want = "QF_API_TOKENS entry 2: empty tenant after '@'\nQF_API_TOKENS entry 4: role 1 after '#' is empty or unknown (want gateway, report, billing or admin, joined with '+')"
	if err == nil || err.Error() != want {
		t.Errorf("ParseEntries error =\n%v\nwant\n%s", err, want)
	}
	if err != nil && (strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "good-token")) {
		t.Errorf("ParseEntries error repeats a token: %v", err)
	}
}

// An Entry formatted or logged shows its grant, never its digest.
func TestEntryHidesDigest(t *testing.T) {
	e, err := ParseEntry("s3cret-token@acme#report")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("s3cret-token"))
	var logs bytes.Buffer
	slog.New(slog.NewJSONHandler(&logs, nil)).Info("entry", "entry", e, "entries", []Entry{e})
	for _, s := range []string{fmt.Sprintf("%v %+v %s", e, e, []Entry{e}), logs.String()} {
		if strings.Contains(s, hex.EncodeToString(sum[:])) || strings.Contains(s, fmt.Sprint(sum[0], " ", sum[1])) ||
			strings.Contains(s, "s3cret") {
			t.Errorf("Entry formats as %q", s)
		}
	}
	if got := e.String(); got != "token for one tenant as report" {
		t.Errorf("Entry.String() = %q", got)
	}
}

func TestRoles(t *testing.T) {
	for _, tc := range []struct {
		held, want Roles
		has        bool
	}{
		{Gateway, Gateway, true},
		{Gateway, Report, false},
		{DefaultRoles, Report, true},
		{DefaultRoles, Billing, false},
		{Admin, Billing, true},
		{Admin, Gateway, true},
		{0, Gateway, false},
	} {
		if got := tc.held.Has(tc.want); got != tc.has {
			t.Errorf("(%v).Has(%v) = %v, want %v", tc.held, tc.want, got, tc.has)
		}
	}
	if s := (Gateway | Billing).String(); s != "gateway+billing" {
		t.Errorf("String() = %q", s)
	}
}
