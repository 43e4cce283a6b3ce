package auth

import (
	"crypto/sha256"
	"strings"
	"testing"

	"quotaflow/internal/auth/authtest"
)

func TestParseFile(t *testing.T) {
	src := `
# rotated by the platform team
- token: s3cret-gateway
- {token: "s3cret-acme", tenant: "acme#1,eu", roles: [report]}
- sha256: ` + strings.ToUpper(authtest.SHA256Hex("s3cret-billing")) + `
  roles: [billing, gateway]
- {sha256: ` + authtest.SHA256Hex("s3cret-admin") + `, roles: [admin]}
- &shared {token: 12345, tenant: beta}
- *shared
`
	es, err := ParseFile([]byte(src))
	if err != nil {
		t.Fatalf("ParseFile error = %v", err)
	}
	want := []struct {
		token, tenant string
		roles         Roles
	}{
		{"s3cret-gateway", "", Gateway | Report},
		{"s3cret-acme", "acme#1,eu", Report}, // the file takes tenants QF_API_TOKENS cannot
		{"s3cret-billing", "", Billing | Gateway},
		{"s3cret-admin", "", Admin},
		{"12345", "beta", Gateway | Report}, // a YAML number is the token as written
		{"12345", "beta", Gateway | Report},
	}
	if len(es) != len(want) {
		t.Fatalf("ParseFile = %d entries, want %d", len(es), len(want))
	}
	for i, w := range want {
		if es[i].digest != sha256.Sum256([]byte(w.token)) || es[i].Tenant != w.tenant || es[i].Roles != w.roles {
			t.Errorf("entry %d = %v for %q, want the token %q for %q as %v", i, es[i], es[i].Tenant, w.token, w.tenant, w.roles)
		}
	}
	if es, err := ParseFile([]byte("[]\n")); err != nil || len(es) != 0 {
		t.Errorf("ParseFile([]) = %v, %v; want no entries", es, err)
	}
}

func TestParseFileErrors(t *testing.T) {
	const tok = "s3cret-token"
	sum := authtest.SHA256Hex(tok)
	for _, tc := range []struct{ name, src, want string }{
		{"empty", "", "file is empty; write [] for a file of no tokens"},
		{"comments only", "# none yet\n", "file is empty; write [] for a file of no tokens"},
		{"a mapping", "token: " + tok, "file must be a list of entries of token or sha256, tenant, roles"},
		{"a scalar item", "- " + tok, "[0]: must be a mapping of token or sha256, tenant, roles"},
		{"unknown field", "- {token: a-token}\n- token: b-token\n  tenat: acme", "[1]: unknown field on line 3 (want token or sha256, tenant, roles)"},
		{"a token as a key", "- " + tok + ": x", "[0]: unknown field on line 1 (want token or sha256, tenant, roles)\n[0]: token or sha256 required"},
		{"neither", "- {tenant: acme}", "[0]: token or sha256 required"},
		{"both", "- {token: " + tok + ", sha256: " + sum + "}", "[0]: give token or sha256, not both"},
		{"twice", "- {token: " + tok + ", token: " + tok + "}", "[0].token: given twice"},
		{"roles twice", "- {token: " + tok + ", roles: [report], roles: [report]}", "[0].roles: given twice"},
		{"null token", "- {token: , roles: [gateway]}", "[0].token: must be a string\n[0]: token or sha256 required"},
		{"token a list", "- {token: [" + tok + "]}", "[0].token: must be a string\n[0]: token or sha256 required"},
		{"white space", "- {token: 's3cret token'}", "[0].token: token contains white space or a control character"},
		{"short digest", "- {sha256: " + sum[:63] + "}", "[0].sha256: want the 64 hex digits of the token's SHA-256"},
		{"long digest", "- {sha256: " + sum + "00}", "[0].sha256: want the 64 hex digits of the token's SHA-256"},
		{"not hex", "- {sha256: " + strings.Repeat("g", 64) + "}", "[0].sha256: want the 64 hex digits of the token's SHA-256"},
		{"empty tenant", "- {token: " + tok + ", tenant: ''}", "[0].tenant: empty tenant"},
		{"null tenant", "- {token: " + tok + ", tenant: ~}", "[0].tenant: must be a string"},
		{"control tenant", "- {token: " + tok + ", tenant: \"s3cret\\0\"}", "[0].tenant: tenant contains a control character"},
		{"unknown role", "- {token: " + tok + ", roles: [gateway, s3cret]}", "[0].roles[1]: unknown role (want gateway, report, billing or admin)"},
		{"role a list", "- {token: " + tok + ", roles: [[gateway]]}", "[0].roles[0]: unknown role (want gateway, report, billing or admin)"},
		{"roles a string", "- {token: " + tok + ", roles: gateway}", "[0].roles: must be a list of roles (want gateway, report, billing or admin)"},
		{"no roles", "- {token: " + tok + ", roles: []}", "[0].roles: empty: leave roles out for gateway and report"},
		{"bound admin", "- {token: " + tok + ", tenant: acme, roles: [admin]}", "[0].roles: role admin acts for every tenant and cannot be bound to one"},
		{"every mistake", "- {token: " + tok + "}\n- {tenant: acme}\n- {sha256: nope, roles: [root]}",
			"[1]: token or sha256 required\n[2].sha256: want the 64 hex digits of the token's SHA-256\n[2].roles[0]: unknown role (want gateway, report, billing or admin)"},
		{"two documents", "- {token: a-token}\n---\n- {token: b-token}", "file holds more than one YAML document (line 2)"},
		{"syntax", "- {token: " + tok + "\n", "parse file: yaml: line 1: did not find expected ',' or '}'"},
		{"too large", "# " + strings.Repeat("x", MaxFileSize), "file is larger than 1048576 bytes (1 MiB)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseFile([]byte(tc.src))
			if err == nil || err.Error() != tc.want {
				t.Fatalf("ParseFile error =\n%v\nwant\n%s", err, tc.want)
			}
			if strings.Contains(err.Error(), marker) || strings.Contains(err.Error(), sum[:16]) {
				t.Errorf("ParseFile error %q repeats a token or digest", err)
			}
		})
	}
}
