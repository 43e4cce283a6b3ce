package limits

import "strings"

// Key layout. Every key starts with "q" and a Redis Cluster hash tag:
//
//	q{T}u:U:L     user U's counter of limit L (plan limits by name, endpoint
//	              per-user limits as e:E:L), tenant T
//	q{T}t:L       tenant T's tenant-wide counter of limit L
//	q{T}r:U:R     reservation record of request R of user U
//	q{T}v:U       user U's version; q{T}v the tenant's version
//	q{T}b:R       marker of the balance top-up with reference R
//	q{%gE}L       global counter of limit L of endpoint E
//	q{%iA}L       counter of limit L of client IP A
//	qe{S}         epoch key of the cluster slot that tag S hashes to (epoch.go)
//
// Identifiers are escaped (esc) so that no two different tenants, users,
// endpoints or request ids ever produce the same key, whatever characters
// they contain, and so that a tenant can never choose the tag of another
// tenant or of a shared scope: escaped text holds no '{', '}' or ':', and its
// '%' is always followed by two hex digits, so the "%g" and "%i" tags of the
// shared scopes cannot be spelled by a tenant.

// esc percent-escapes the bytes that carry meaning in a key.
func esc(s string) string {
	if !strings.ContainsAny(s, "%{}:") {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '%':
			b.WriteString("%25")
		case '{':
			b.WriteString("%7B")
		case '}':
			b.WriteString("%7D")
		case ':':
			b.WriteString("%3A")
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// subjectKeys builds the keys of one (tenant, user).
type subjectKeys struct {
	prefix string // q{T}
	user   string // escaped user
}

func newSubjectKeys(tenant, user string) subjectKeys {
	return subjectKeys{prefix: "q{" + esc(tenant) + "}", user: esc(user)}
}

// tag returns the hash tag's content, which decides the cluster slot.
func (k subjectKeys) tag() string { return k.prefix[2 : len(k.prefix)-1] }

func (k subjectKeys) limit(r *Rule) string {
	name := esc(r.Name)
	if r.Scope == ScopeTenant {
		return k.prefix + "t:" + name
	}
	if r.Endpoint != "" {
		return k.prefix + "u:" + k.user + ":e:" + esc(r.Endpoint) + ":" + name
	}
	return k.prefix + "u:" + k.user + ":" + name
}

func (k subjectKeys) reservation(requestID string) string {
	return k.prefix + "r:" + k.user + ":" + esc(requestID)
}

func (k subjectKeys) version() string       { return k.prefix + "v:" + k.user }
func (k subjectKeys) tenantVersion() string { return k.prefix + "v" }

func (k subjectKeys) topup(reference string) string {
	return k.prefix + "b:" + esc(reference)
}

// sharedTag returns the hash tag content of a shared (global or IP) scope.
// Each endpoint and each IP has its own tag, so a cluster spreads them.
func sharedTag(scope Scope, id string) string {
	if scope == ScopeIP {
		return "%i" + esc(id)
	}
	return "%g" + esc(id)
}

func sharedKey(tag string, r *Rule) string {
	return "q{" + tag + "}" + esc(r.Name)
}
