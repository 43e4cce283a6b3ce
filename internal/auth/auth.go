// Package auth is the bearer-token authentication of admission's API and of
// the accounter's console (docs/design.md §4): the token entries of
// QF_API_TOKENS and QF_API_TOKENS_FILE, the roles they grant, the tenant
// they may be bound to, and the reload of the file while the service runs.
//
// Tokens are kept only as SHA-256 digests. Neither a token nor its digest
// is ever logged or put in an error; errors name an entry by its position
// and say what is wrong with it, without quoting any part of it, since an
// operator's mistake (a '#' or '@' inside a token) can move part of a token
// into the tenant or the roles.
package auth

import (
	"crypto/sha256"
	"crypto/subtle"
	"slices"
	"strings"
)

// Roles is a set of roles, one bit each. The zero Roles holds none.
type Roles uint8

// The roles a token can hold.
const (
	// Gateway checks requests: POST /v1/admit, /v1/authz, POST
	// /v1/release, GET /v1/usage and the gRPC checks (ShouldRateLimit).
	Gateway Roles = 1 << iota
	// Report reports actual usage: POST /v1/usage.
	Report
	// Billing adds prepaid credits: POST /v1/balances/topup.
	Billing
	// Admin does everything, for any tenant and any plan; it cannot be
	// bound to a tenant.
	Admin
)

// DefaultRoles are the roles of an entry that names none: a gateway that
// also reports usage, but cannot mint credits.
const DefaultRoles = Gateway | Report

// roleNames lists the roles as entries write them, in the order messages
// name them.
var roleNames = [...]struct {
	name string
	role Roles
}{{"gateway", Gateway}, {"report", Report}, {"billing", Billing}, {"admin", Admin}}

// wantRoles ends the message about an unknown role.
const wantRoles = "want gateway, report, billing or admin"

// parseRole returns the role named s.
func parseRole(s string) (Roles, bool) {
	for _, r := range roleNames {
		if r.name == s {
			return r.role, true
		}
	}
	return 0, false
}

// Has reports whether rs allows what role allows: it holds role, or Admin.
func (rs Roles) Has(role Roles) bool { return rs&Admin != 0 || rs&role == role }

// String joins the role names with '+', as QF_API_TOKENS writes them.
func (rs Roles) String() string {
	var names []string
	for _, r := range roleNames {
		if rs&r.role != 0 {
			names = append(names, r.name)
		}
	}
	return strings.Join(names, "+")
}

// Grant is what one token entry allows: Roles, for Tenant only or, when
// Tenant is empty, for every tenant.
type Grant struct {
	Tenant string
	Roles  Roles
}

// Entry is one token entry: its token's SHA-256 digest and its grant. It
// never holds the token, and formatting or logging it shows only the grant.
type Entry struct {
	digest [sha256.Size]byte
	Grant
}

// String describes e without its digest.
func (e Entry) String() string {
	if e.Tenant == "" {
		return "token for every tenant as " + e.Roles.String()
	}
	return "token for one tenant as " + e.Roles.String()
}

// Set is an immutable set of token entries: what Authenticate compares a
// request's token with. Build one with NewSet.
type Set struct {
	tokens []token
}

// token is one distinct digest and the grants of every entry that has it:
// a token may be listed several times, for several tenants.
type token struct {
	digest [sha256.Size]byte
	grants []Grant
}

// NewSet returns the set of every entry of lists (QF_API_TOKENS and the
// file's, say): the union of what they grant.
func NewSet(lists ...[]Entry) *Set {
	s := &Set{}
	at := map[[sha256.Size]byte]int{}
	for _, list := range lists {
		for _, e := range list {
			i, ok := at[e.digest]
			if !ok {
				i = len(s.tokens)
				at[e.digest] = i
				s.tokens = append(s.tokens, token{digest: e.digest})
			}
			s.tokens[i].grants = append(s.tokens[i].grants, e.Grant)
		}
	}
	return s
}

// Len is the number of distinct tokens in s.
func (s *Set) Len() int { return len(s.tokens) }

// lookup returns the grants of tok. It compares tok's digest with every
// token's in constant time and picks the match without a branch, so the
// time taken reveals neither which token matched nor how much of a token
// was right. It does not allocate.
func (s *Set) lookup(tok string) ([]Grant, bool) {
	d := sha256.Sum256([]byte(tok))
	match := -1
	for i := range s.tokens {
		eq := subtle.ConstantTimeCompare(d[:], s.tokens[i].digest[:])
		match = subtle.ConstantTimeSelect(eq, i, match)
	}
	if match < 0 {
		return nil, false
	}
	return s.tokens[match].grants, true
}

// bearer returns the token of an "Authorization: Bearer" header value (of
// HTTP or of gRPC metadata).
func bearer(header string) (string, bool) {
	scheme, tok, found := strings.Cut(header, " ")
	if !found || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}

// Principal is what the bearer of a request's token may do: the grants of
// every entry of its token, seen in the role the request needs (As). The
// zero Principal may do nothing.
type Principal struct {
	grants []Grant // shared with the Set: never modified
	role   Roles
}

// everyone is the principal of every request when there is no
// authentication.
var everyone = []Grant{{Roles: Admin}}

// As returns p acting in role: Allowed and For then consider only the
// grants that allow it (before As, every grant counts).
func (p Principal) As(role Roles) Principal {
	p.role = role
	return p
}

// Allowed reports whether some grant of p allows its role, for some
// tenant: a request whose token lacks the route's role is refused before
// its body is read.
func (p Principal) Allowed() bool {
	for _, g := range p.grants {
		if g.Roles.Has(p.role) {
			return true
		}
	}
	return false
}

// For reports whether p may act in its role for tenant and, when it may,
// whether it may name any plan. A grant for every tenant (the platform's
// own gateway, or an admin) may name any plan; a grant bound to the tenant
// only the plans the policy grants that tenant (policy.Policy.Grants):
// NamesPlan checks both.
func (p Principal) For(tenant string) (ok, anyPlan bool) {
	for _, g := range p.grants {
		if !g.Roles.Has(p.role) {
			continue
		}
		switch g.Tenant {
		case "":
			return true, true
		case tenant:
			ok = true
		}
	}
	return ok, false
}

// Granter says which plans a tenant's own token may name
// (*policy.Policy).
type Granter interface {
	Grants(tenant, plan string) bool
}

// NamesPlan reports whether p may name plan for tenant in its role: it may
// act for tenant (For), and a grant for every tenant names any plan, a
// grant bound to tenant only the plans g grants it (an empty plan is the
// tenant's own). Admission asks it of every plan a request names, the
// console of every plan a viewer reads (in no role: every grant counts).
func (p Principal) NamesPlan(g Granter, tenant, plan string) bool {
	ok, anyPlan := p.For(tenant)
	return ok && (anyPlan || g.Grants(tenant, plan))
}

// Reads reports whether p may read tenant's usage (the console): an admin
// grant reads every tenant, a grant bound to tenant reads it whatever its
// roles. A grant for every tenant that is not admin (the platform's
// gateway) reads none: it may act for any tenant, not look at them all.
func (p Principal) Reads(tenant string) bool {
	for _, g := range p.grants {
		if g.Roles.Has(Admin) || (g.Tenant != "" && g.Tenant == tenant) {
			return true
		}
	}
	return false
}

// ReadsAll reports whether p may read every tenant's usage: it has an
// admin grant.
func (p Principal) ReadsAll() bool {
	for _, g := range p.grants {
		if g.Roles.Has(Admin) {
			return true
		}
	}
	return false
}

// Tenants returns the tenants p's grants are bound to, each once, in the
// order of its entries: what a token that does not read all may read.
func (p Principal) Tenants() []string {
	var ts []string
	for _, g := range p.grants {
		if g.Tenant != "" && !slices.Contains(ts, g.Tenant) {
			ts = append(ts, g.Tenant)
		}
	}
	return ts
}
