package httpapi

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"
)

// Auth checks bearer tokens against QF_API_TOKENS. Each entry is "token"
// (valid for every tenant) or "token@tenant" (valid for that tenant only;
// the token ends at the first '@', the tenant may contain more). A token may
// be listed several times with different tenants.
//
// Tokens are kept as SHA-256 digests and every request is compared against
// every entry with subtle.ConstantTimeCompare, so the time taken reveals
// neither which entry matched nor how much of a token was right. Neither
// tokens nor their digests are ever logged or put in errors.
//
// A nil *Auth accepts every request (QF_API_TOKENS empty).
type Auth struct {
	entries []tokenEntry
}

type tokenEntry struct {
	digest [sha256.Size]byte
	tenant string // "" = any tenant
}

// NewAuth parses the QF_API_TOKENS entries (already split at commas;
// surrounding spaces are trimmed, empty entries skipped). It returns nil and
// no error when there is no entry: no authentication.
func NewAuth(list []string) (*Auth, error) {
	a := &Auth{}
	for i, raw := range list {
		raw = strings.TrimSpace(raw)
		if raw == "" {
			continue
		}
		token, tenant, scoped := strings.Cut(raw, "@")
		switch {
		case token == "":
			return nil, fmt.Errorf("QF_API_TOKENS entry %d: empty token", i+1)
		case scoped && tenant == "":
			return nil, fmt.Errorf("QF_API_TOKENS entry %d: empty tenant after '@'", i+1)
		case strings.ContainsAny(token, " \t\r\n"):
			return nil, fmt.Errorf("QF_API_TOKENS entry %d: token contains white space", i+1)
		case !utf8.ValidString(tenant) || len(tenant) > maxID:
			return nil, fmt.Errorf("QF_API_TOKENS entry %d: tenant must be valid UTF-8 of at most %d bytes", i+1, maxID)
		}
		a.entries = append(a.entries, tokenEntry{digest: sha256.Sum256([]byte(token)), tenant: tenant})
	}
	if len(a.entries) == 0 {
		return nil, nil
	}
	return a, nil
}

// principal is what a request's token allows.
type principal struct {
	any     bool     // every tenant
	tenants []string // else these
}

// allows reports whether the principal may act for tenant.
func (p principal) allows(tenant string) bool {
	if p.any {
		return true
	}
	for _, t := range p.tenants {
		if t == tenant {
			return true
		}
	}
	return false
}

// authenticate returns the principal of r's bearer token; ok is false when
// the token is missing or unknown (401).
func (a *Auth) authenticate(r *http.Request) (p principal, ok bool) {
	if a == nil {
		return principal{any: true}, true
	}
	h := r.Header.Get("Authorization")
	scheme, token, found := strings.Cut(h, " ")
	if !found || !strings.EqualFold(scheme, "Bearer") {
		return principal{}, false
	}
	token = strings.TrimSpace(token)
	if token == "" {
		return principal{}, false
	}
	d := sha256.Sum256([]byte(token))
	// No early exit: every entry is compared.
	for _, e := range a.entries {
		if subtle.ConstantTimeCompare(d[:], e.digest[:]) == 1 {
			ok = true
			if e.tenant == "" {
				p.any = true
			} else {
				p.tenants = append(p.tenants, e.tenant)
			}
		}
	}
	return p, ok
}
