package httpapi

import (
	"context"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	"quotaflow/internal/auth"
	"quotaflow/services/admission/internal/decide"
)

// Headers /v1/authz reads. The gateway sets them itself, overwriting
// whatever the client sent.
const (
	hdrTenant          = "X-Quota-Tenant"
	hdrUser            = "X-Quota-User"
	hdrPlan            = "X-Quota-Plan"
	hdrEstimated       = "X-Quota-Estimated-Tokens"
	hdrModel           = "X-Quota-Model"
	hdrInputTokens     = "X-Quota-Input-Tokens"
	hdrMaxOutputTokens = "X-Quota-Max-Output-Tokens"
	hdrRequestID       = "X-Request-Id"
	hdrRealIP          = "X-Real-IP"
	hdrForwardedFor    = "X-Forwarded-For"
	hdrOriginalURI     = "X-Original-URI"
	hdrForwardedURI    = "X-Forwarded-Uri"
)

// serveAuthz is the admission check for gateways that can only forward a
// request: nginx auth_request, Envoy ext_authz (HTTP), Traefik forwardAuth,
// Caddy forward_auth.
func (h *Handler) serveAuthz(w http.ResponseWriter, r *http.Request) {
	p, ok := h.authenticate(w, r, auth.Gateway)
	if !ok {
		return
	}
	h.check(r.Context(), w, p, httpCheck{r: r, trusted: h.trusted}, h.deny)
}

// checkSource is a gateway's check request, whatever protocol carried it:
// the original request's headers, its endpoint and its client's IP.
type checkSource interface {
	// header returns one of the original request's headers by the
	// canonical name /v1/authz reads ("" when absent).
	header(name string) string
	endpoint() (string, *fieldError)
	clientIP() (string, *fieldError)
}

// httpCheck is a /v1/authz request.
type httpCheck struct {
	r       *http.Request
	trusted []netip.Prefix
}

func (c httpCheck) header(name string) string       { return c.r.Header.Get(name) }
func (c httpCheck) endpoint() (string, *fieldError) { return authzEndpoint(c.r) }
func (c httpCheck) clientIP() (string, *fieldError) { return clientIP(c.r, c.trusted) }

// check is the admission check behind /v1/authz and Check: it writes the
// answer to w, a denial with denyStatus, and returns what is wrong with a
// request that cannot be checked ("" otherwise).
func (h *Handler) check(ctx context.Context, w http.ResponseWriter, p auth.Principal, src checkSource, denyStatus int) (invalid string) {
	pol := h.policy()
	in, ferr := decodeCheck(src, pol.Cost)
	if ferr != nil {
		denyInvalid(w, denyStatus, ferr.Error())
		return ferr.Error()
	}
	if !authorizePlan(w, p, pol, in.Tenant, in.Plan) {
		return ""
	}
	// Every check is a new upstream request: a request id any
	// reservation holds is a denial, never a replayed allow.
	in.Fresh = true
	return h.decide(ctx, w, routeAuthz, in, denyStatus, true)
}

// ProblemInvalidRequest is the RFC 9457 problem type of a /v1/authz
// request that cannot be checked (a missing or invalid header, endpoint or
// number). It is a tag URI (RFC 4151): nothing to dereference.
const ProblemInvalidRequest = "tag:quotaflow,2025:problem:invalid-request"

// reasonInvalidRequest is the reason of such a denial.
const reasonInvalidRequest = "invalid_request"

// denyInvalid answers a check that cannot be made with status (the
// configured denial status on /v1/authz), never a 400: nginx's
// auth_request turns every status but 2xx, 401 and 403 into a 500, which
// would hide the caller's mistake behind a server error. The problem body
// says what is wrong (detail is "<field>: <what is wrong>"); there is no
// Retry-After, since the same request never fits.
func denyInvalid(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("X-Quota-Denied", "1")
	writeDecision(w, status, problemType, &decisionBody{
		Type: ProblemInvalidRequest, Title: "Request cannot be checked: invalid input", Status: status,
		Detail: detail, Reason: reasonInvalidRequest, Limits: []limitJSON{},
	})
}

// decodeCheck reads an admission request from a gateway's check: identity
// and estimate from its headers, then its endpoint and client IP.
func decodeCheck(src checkSource, cost costFunc) (decide.Input, *fieldError) {
	in := decide.Input{
		Tenant:    src.header(hdrTenant),
		User:      src.header(hdrUser),
		Plan:      src.header(hdrPlan),
		Model:     src.header(hdrModel),
		RequestID: src.header(hdrRequestID),
	}
	for _, f := range []struct {
		name, v  string
		required bool
	}{
		{hdrRequestID, in.RequestID, false},
		{hdrTenant, in.Tenant, true},
		{hdrUser, in.User, true},
		{hdrPlan, in.Plan, false},
		{hdrModel, in.Model, false},
	} {
		if ferr := checkID(f.name, f.v, f.required); ferr != nil {
			return decide.Input{}, ferr
		}
	}
	ep, ferr := src.endpoint()
	if ferr != nil {
		return decide.Input{}, ferr
	}
	in.Endpoint = ep
	ip, ferr := src.clientIP()
	if ferr != nil {
		return decide.Input{}, ferr
	}
	in.IP = ip
	var nums [3]*int64
	for i, name := range []string{hdrEstimated, hdrInputTokens, hdrMaxOutputTokens} {
		v := src.header(name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return decide.Input{}, bad(name, "must be a whole number from 0 to 1000000000000")
		}
		nums[i] = &n
	}
	c, ferr := tokensCost(nums[0], nums[1], nums[2], in.Model, cost, hdrEstimated, hdrInputTokens, hdrMaxOutputTokens)
	if ferr != nil {
		return decide.Input{}, ferr
	}
	in.Cost = c
	return in, nil
}

// authzEndpoint is the endpoint of the original request: X-Original-URI
// (nginx), else X-Forwarded-Uri (Traefik), else the path after /v1/authz
// (Envoy appends the original path to its path prefix). The query string is
// dropped and percent-escapes decoded, so /api/%67enerate?x=1 counts as
// /api/generate, like the gateway routes it.
func authzEndpoint(r *http.Request) (string, *fieldError) {
	field, raw := hdrOriginalURI, r.Header.Get(hdrOriginalURI)
	if raw == "" {
		field, raw = hdrForwardedURI, r.Header.Get(hdrForwardedURI)
	}
	if raw == "" {
		field = "endpoint"
		raw = strings.TrimPrefix(r.URL.EscapedPath(), "/v1/authz")
		if raw == "" {
			return "", bad("endpoint", "required: set X-Original-URI or X-Forwarded-Uri, or append the path to /v1/authz")
		}
	}
	return endpointOf(field, raw)
}

// endpointOf is the endpoint of a request URI: the query string dropped
// and percent-escapes decoded.
func endpointOf(field, raw string) (string, *fieldError) {
	if i := strings.IndexAny(raw, "?#"); i >= 0 {
		raw = raw[:i]
	}
	ep, err := url.PathUnescape(raw)
	if err != nil {
		return "", bad(field, "invalid percent-encoding")
	}
	if ferr := checkID(field, ep, true); ferr != nil {
		return "", ferr
	}
	return ep, nil
}

// clientIP is the client address of an authz request: X-Real-IP, else the
// last X-Forwarded-For address that is not a trusted proxy, but only when
// the peer itself is a trusted proxy. Otherwise it is empty: the request
// has no IP layer (the peer is the gateway, whose address would put every
// client in one bucket).
func clientIP(r *http.Request, trusted []netip.Prefix) (string, *fieldError) {
	peer, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil || !isTrusted(peer.Addr().Unmap(), trusted) {
		return "", nil
	}
	if v := strings.TrimSpace(r.Header.Get(hdrRealIP)); v != "" {
		return parseIP(hdrRealIP, v)
	}
	xff := r.Header.Values(hdrForwardedFor)
	if len(xff) == 0 {
		return "", nil
	}
	hops := strings.Split(strings.Join(xff, ","), ",")
	var first string
	for i := len(hops) - 1; i >= 0; i-- {
		hop := strings.TrimSpace(hops[i])
		ip, ferr := parseIP(hdrForwardedFor, hop)
		if ferr != nil {
			return "", ferr
		}
		if ip == "" {
			continue
		}
		first = ip
		if !isTrusted(netip.MustParseAddr(ip), trusted) {
			return ip, nil
		}
	}
	return first, nil // every hop is a trusted proxy: the leftmost one
}

func isTrusted(a netip.Addr, trusted []netip.Prefix) bool {
	for _, p := range trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}
