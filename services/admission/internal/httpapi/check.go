package httpapi

import (
	"context"
	"net/http"

	"quotaflow/internal/auth"
)

// GatewayCheck is a gateway's check request that arrives by another
// protocol than HTTP: Envoy's ext_authz over gRPC (package extauthz).
// Identity and estimate come from its headers, read as /v1/authz reads
// them; the protocol carries the endpoint and the client's address itself.
type GatewayCheck struct {
	// Header returns one of the original request's headers by the
	// canonical name /v1/authz reads (X-Quota-Tenant, X-Request-Id, ...),
	// "" when it is absent.
	Header func(name string) string
	// Path is the original request's path, query string allowed: the
	// endpoint, as in X-Original-URI.
	Path string
	// IP is the client's address as the gateway saw it; "" skips the IP
	// layer.
	IP string
}

func (c GatewayCheck) header(name string) string       { return c.Header(name) }
func (c GatewayCheck) endpoint() (string, *fieldError) { return endpointOf("path", c.Path) }
func (c GatewayCheck) clientIP() (string, *fieldError) { return parseIP("source address", c.IP) }

// CheckAnswer is what /v1/authz would have answered a GatewayCheck.
type CheckAnswer struct {
	// Status is 200 for an allow, 429 for a denial, 403 when the caller
	// may not act for the tenant or plan.
	Status int
	// Header holds the rate-limit headers, Retry-After on a denial that
	// waiting cures, Content-Type and Cache-Control, and X-Quota-Denied
	// on a denial.
	Header http.Header
	// Body is the JSON body: the decision, or a problem on a denial.
	Body []byte
	// Invalid says what is wrong with a request that could not be checked
	// ("<field>: <what is wrong>"; a denial too), "" otherwise.
	Invalid string
}

// Check answers a gateway's check request for p, the caller its protocol
// authenticated (acting in the gateway role), as /v1/authz would answer
// it, except that a denial is always a 429: QF_AUTHZ_DENY_STATUS is for
// nginx.
func (h *Handler) Check(ctx context.Context, p auth.Principal, c GatewayCheck) CheckAnswer {
	w := &answerWriter{header: http.Header{}}
	invalid := h.check(ctx, w, p, c, http.StatusTooManyRequests)
	return CheckAnswer{Status: w.status, Header: w.header, Body: w.body, Invalid: invalid}
}

// answerWriter keeps an answer instead of sending it.
type answerWriter struct {
	header http.Header
	status int
	body   []byte
}

func (w *answerWriter) Header() http.Header { return w.header }

func (w *answerWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

// Write copies b: writeDecision hands back a pooled buffer.
func (w *answerWriter) Write(b []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	w.body = append(w.body, b...)
	return len(b), nil
}
