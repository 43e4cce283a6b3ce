package auth

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"
	"unicode"

	"quotaflow/pkg/ident"
)

// ParseEntries parses QF_API_TOKENS, already split at commas: each entry
// is token[@tenant][#role+role] (see ParseEntry), surrounding white space is
// trimmed and empty entries are skipped. Every bad entry is reported, by
// its position from 1, in one error.
func ParseEntries(list []string) ([]Entry, error) {
	var out []Entry
	var errs []error
	for i, raw := range list {
		raw = strings.TrimSpace(raw)
		if raw == "" {
			continue
		}
		e, err := ParseEntry(raw)
		if err != nil {
			errs = append(errs, fmt.Errorf("QF_API_TOKENS entry %d: %w", i+1, err))
			continue
		}
		out = append(out, e)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// ParseEntry parses one QF_API_TOKENS entry, token[@tenant][#role+role]:
// the token ends at the first '@' or '#'; "@tenant" binds it to that tenant,
// which runs to the next '#' (so it may hold '@', but a tenant holding '#'
// or ',' needs the file); the roles after '#' are joined with '+' and
// default to DefaultRoles. Empty parts, white space or control characters
// in the token, a tenant that is not a valid identifier, unknown roles and
// an admin bound to a tenant are errors, which never quote the entry.
func ParseEntry(s string) (Entry, error) {
	tok, rest := s, ""
	if i := strings.IndexAny(s, "@#"); i >= 0 {
		tok, rest = s[:i], s[i:]
	}
	if msg := tokenProblem(tok); msg != "" {
		return Entry{}, errors.New(msg)
	}
	e := Entry{digest: sha256.Sum256([]byte(tok)), Grant: Grant{Roles: DefaultRoles}}
	if after, bound := strings.CutPrefix(rest, "@"); bound {
		e.Tenant, rest = after, ""
		if i := strings.IndexByte(after, '#'); i >= 0 {
			e.Tenant, rest = after[:i], after[i:]
		}
		if e.Tenant == "" {
			return Entry{}, errors.New("empty tenant after '@'")
		}
		if msg := tenantProblem(e.Tenant); msg != "" {
			return Entry{}, errors.New(msg)
		}
	}
	if after, ok := strings.CutPrefix(rest, "#"); ok {
		if after == "" {
			return Entry{}, errors.New("no role after '#'")
		}
		e.Roles = 0
		for i, name := range strings.Split(after, "+") {
			r, ok := parseRole(name)
			if !ok {
				// Not quoted: with a '#' inside a token, it is part of one.
				return Entry{}, fmt.Errorf("role %d after '#' is empty or unknown (%s, joined with '+')", i+1, wantRoles)
			}
			e.Roles |= r
		}
	}
	if msg := e.Grant.problem(); msg != "" {
		return Entry{}, errors.New(msg)
	}
	return e, nil
}

// tokenProblem says what is wrong with a token, or "". A token travels in
// an Authorization header, which cannot carry white space inside a token
// or control characters.
func tokenProblem(tok string) string {
	switch {
	case tok == "":
		return "empty token"
	case strings.ContainsFunc(tok, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }):
		return "token contains white space or a control character"
	}
	return ""
}

// tenantProblem says why tenant is not a valid identifier (ident.Check),
// or "". It does not quote the tenant.
func tenantProblem(tenant string) string {
	if tenant == "" {
		return "empty tenant"
	}
	if err := ident.Check(tenant); err != nil {
		return "tenant " + err.Error()
	}
	return ""
}

// problem says what is wrong with a grant as a whole, or "".
func (g Grant) problem() string {
	if g.Roles&Admin != 0 && g.Tenant != "" {
		return "role admin acts for every tenant and cannot be bound to one"
	}
	return ""
}
