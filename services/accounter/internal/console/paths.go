package console

import (
	"net/url"
	"strings"
)

// tenantPath returns the path of a tenant's page: sub is "" (its users) or
// "/near", "/usage" and the like. Any identifier is a tenant (ident.Check),
// so its segment is escaped (tenantSegment) for "/", "?" and "#" to stay
// in it.
func tenantPath(tenant, sub string) string {
	return "/tenants/" + tenantSegment(tenant) + sub
}

// tenantSegment is tenant as one path segment. Escaping is not enough for
// "." and "..": browsers resolve them as dot segments even percent-encoded
// (WHATWG URL), so a segment starting with "~" carries the id after it, and
// those ids and the ids starting with "~" take that form. tenantOf undoes
// it.
func tenantSegment(tenant string) string {
	if tenant == "." || tenant == ".." || strings.HasPrefix(tenant, "~") {
		tenant = "~" + tenant
	}
	return url.PathEscape(tenant)
}

// tenantOf is the tenant a path segment (decoded, as http.Request.PathValue
// gives it) names.
func tenantOf(segment string) string {
	return strings.TrimPrefix(segment, "~")
}
