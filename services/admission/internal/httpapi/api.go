// Package httpapi is admission's HTTP API (docs/design.md §4): POST /v1/admit,
// /v1/authz (any method, any path under it), POST /v1/release, POST and GET
// /v1/usage and POST /v1/balances/topup, with bearer-token authentication
// and the tokens' roles, tenants and plans (package auth), strict request
// validation, the IETF RateLimit headers and RFC 9457
// problem bodies for denials. Handler.Check is /v1/authz's check for a
// gateway that speaks another protocol (Envoy's ext_authz over gRPC,
// package extauthz).
//
// It decides nothing itself: a Decider (package decide) does, and an Events
// sink (package outbox) publishes what happened. A failure of the Decider's
// infrastructure never becomes a 5xx on the admission path: the request is
// allowed and counted in quotaflow_admission_api_failopen_total, because a
// gateway that cannot reach its quota check must not fail its own traffic.
package httpapi

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/auth"
	"quotaflow/internal/obs"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/outbox"
)

// MaxBodyBytes is the largest request body accepted (64 KiB); a larger
// one is answered 413 before any of it is parsed.
const MaxBodyBytes = 64 << 10

// ProblemQuotaExceeded is the RFC 9457 problem type of a denial
// (draft-ietf-httpapi-ratelimit-headers §5.1).
const ProblemQuotaExceeded = "https://iana.org/assignments/http-problem-types#quota-exceeded"

// Decider makes and undoes admission decisions: *decide.Decider. Errors
// wrapping limits.ErrInvalid or policy.ErrUnknownPlan are the caller's
// fault (400); any other error is an infrastructure failure.
type Decider interface {
	Admit(ctx context.Context, in decide.Input) (decide.Result, error)
	Release(ctx context.Context, tenant, user, requestID string) (limits.Settlement, error)
	Usage(ctx context.Context, tenant, user, plan string) ([]decide.LimitState, error)
	TopUp(ctx context.Context, tenant, user string, amount int64, reference string) (limits.TopUpResult, error)
}

// Events receives what the API did: *outbox.Outbox. Enqueue and Denied
// must not block; PublishNow returns once the stream stored every event,
// or when ctx ends or timeout has passed (an error wrapping
// context.DeadlineExceeded).
type Events interface {
	Enqueue(ev events.Event)
	Denied(d events.Denied, at time.Time)
	PublishNow(ctx context.Context, evs []events.Event, timeout time.Duration) error
}

// Options configure the API. Decider, Policy and Events are required.
type Options struct {
	// Decider makes the decisions (*decide.Decider).
	Decider Decider
	// Policy returns the policy in force (service.PolicyWatcher.Current): the
	// model weights for input/output token costs and the windows shown in
	// RateLimit-Policy.
	Policy func() *policy.Policy
	// Events publishes what happened (*outbox.Outbox).
	Events Events
	// Auth checks bearer tokens and their roles; nil accepts every
	// request.
	Auth *auth.Auth
	// AuthzDenyStatus is the status of a denial on /v1/authz: 429
	// (default; Envoy passes it through) or 403 (nginx auth_request
	// treats only 401 and 403 as denials).
	AuthzDenyStatus int
	// TrustedProxies are the peers whose X-Real-IP and X-Forwarded-For
	// headers /v1/authz believes. From other peers those headers are
	// ignored and the request has no client IP (the IP layer is skipped).
	TrustedProxies []netip.Prefix
	// Source is the CloudEvents source of the events (default
	// outbox.DefaultSource, as the outbox's own events).
	Source string
	// UsageTimeout bounds how long POST /v1/usage waits for the stream's
	// acknowledgements (default 5 s).
	UsageTimeout time.Duration
	// MaxEventAge is how long the usage stream keeps events (its MaxAge):
	// POST /v1/usage refuses an event older than that, which the
	// consumers would dead-letter (default stream.Defaults().MaxAge).
	MaxEventAge time.Duration
	// Log receives errors and per-request debug lines (never tokens); nil
	// discards them.
	Log *slog.Logger
	// Registerer receives the API's metrics; nil registers nothing.
	Registerer prometheus.Registerer
}

// Handler serves the API. Create it with New.
type Handler struct {
	dec      Decider
	policy   func() *policy.Policy
	ev       Events
	tokens   *auth.Auth
	deny     int
	trusted  []netip.Prefix
	source   string
	usageTO  time.Duration
	maxAge   time.Duration
	log      *slog.Logger
	mux      *http.ServeMux
	authz    http.Handler
	duration *prometheus.HistogramVec
	failopen *prometheus.CounterVec
}

// Route labels of quotaflow_admission_request_duration_seconds.
const (
	routeAdmit       = "admit"
	routeAuthz       = "authz"
	routeRelease     = "release"
	routeUsageReport = "usage_report"
	routeUsageGet    = "usage_get"
	routeTopUp       = "topup"
)

// DefaultAuthzDenyStatus is the status of a /v1/authz denial unless
// Options say otherwise: 429, which Envoy passes through.
const DefaultAuthzDenyStatus = http.StatusTooManyRequests

// New returns the API handler.
func New(o Options) (*Handler, error) {
	if o.Decider == nil || o.Policy == nil || o.Events == nil {
		return nil, errors.New("httpapi: Decider, Policy and Events are required")
	}
	switch o.AuthzDenyStatus {
	case 0:
		o.AuthzDenyStatus = DefaultAuthzDenyStatus
	case http.StatusTooManyRequests, http.StatusForbidden:
	default:
		return nil, fmt.Errorf("httpapi: authz deny status %d: want 429 or 403", o.AuthzDenyStatus)
	}
	if o.Source == "" {
		o.Source = outbox.DefaultSource
	}
	if o.UsageTimeout <= 0 {
		o.UsageTimeout = 5 * time.Second
	}
	if o.MaxEventAge <= 0 {
		o.MaxEventAge = stream.Defaults().MaxAge
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	h := &Handler{
		dec: o.Decider, policy: o.Policy, ev: o.Events, tokens: o.Auth, deny: o.AuthzDenyStatus,
		trusted: o.TrustedProxies, source: o.Source, usageTO: o.UsageTimeout, maxAge: o.MaxEventAge,
		log: o.Log.With("component", "httpapi"),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "quotaflow_admission_request_duration_seconds",
			Help: "Time to answer an API request, by route and status class.",
			// 50 µs to about 1.6 s: admits take well under a millisecond.
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16),
		}, []string{"route", "code"}),
		failopen: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_api_failopen_total",
			Help: "Admission requests allowed because the decider failed unexpectedly (should stay 0: the decider handles Redis outages itself).",
		}, []string{"route"}),
	}
	routes := []string{routeAdmit, routeAuthz, routeRelease, routeUsageReport, routeUsageGet, routeTopUp}
	for _, r := range routes {
		for _, c := range obs.CodeClasses {
			h.duration.WithLabelValues(r, c)
		}
	}
	h.failopen.WithLabelValues(routeAdmit)
	h.failopen.WithLabelValues(routeAuthz)
	h.failopen.WithLabelValues(routeLLM)
	if o.Registerer != nil {
		if err := o.Registerer.Register(h.duration); err != nil {
			return nil, fmt.Errorf("httpapi: %w", err)
		}
		if err := o.Registerer.Register(h.failopen); err != nil {
			return nil, fmt.Errorf("httpapi: %w", err)
		}
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/admit", h.instrument(routeAdmit, h.serveAdmit))
	mux.Handle("POST /v1/release", h.instrument(routeRelease, h.serveRelease))
	mux.Handle("POST /v1/usage", h.instrument(routeUsageReport, h.serveUsageReport))
	mux.Handle("GET /v1/usage", h.instrument(routeUsageGet, h.serveUsageGet))
	mux.Handle("POST /v1/balances/topup", h.instrument(routeTopUp, h.serveTopUp))
	h.mux = mux
	h.authz = h.instrument(routeAuthz, h.serveAuthz)
	return h, nil
}

// ServeHTTP routes a request. /v1/authz and everything under it bypass
// the ServeMux, which would redirect an uncleaned path (a "//" or ".." in
// the original URI that Envoy appends) instead of answering it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := r.URL.EscapedPath()
	if p == "/v1/authz" || strings.HasPrefix(p, "/v1/authz/") {
		h.authz.ServeHTTP(w, r)
		return
	}
	h.mux.ServeHTTP(w, r)
}

// statusWriter records the status code for the duration metric.
// statusWriters recycles them: a handler is done with its writer once it
// returns (none hands it to a goroutine), and a wrapper passed as an
// interface would be an allocation a request.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

var statusWriters = sync.Pool{New: func() any { return new(statusWriter) }}

func (h *Handler) instrument(route string, f http.HandlerFunc) http.Handler {
	// The route's series, looked up once rather than per request.
	observers := map[string]prometheus.Observer{}
	for _, c := range obs.CodeClasses {
		observers[c] = h.duration.WithLabelValues(route, c)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := statusWriters.Get().(*statusWriter)
		*sw = statusWriter{ResponseWriter: w}
		f(sw, r)
		code := sw.code
		*sw = statusWriter{}
		statusWriters.Put(sw)
		if code == 0 {
			code = http.StatusOK
		}
		took := time.Since(start)
		observers[obs.CodeClass(code)].Observe(took.Seconds())
		if h.log.Enabled(r.Context(), slog.LevelDebug) { // no boxing of the arguments otherwise
			h.log.Debug("request", "route", route, "method", r.Method, "code", code, "duration", took)
		}
	})
}

// errorBody is every non-decision error response.
type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, contentType string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"code":500,"message":"encoding the response failed"}`)
	}
	w.Header().Set("Content-Type", contentType)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func writeError(w http.ResponseWriter, status int, msg string) {
	if status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="quotaflow"`)
	}
	writeJSON(w, status, "application/json", errorBody{Code: status, Message: msg})
}

func writeFieldError(w http.ResponseWriter, e *fieldError) {
	writeError(w, http.StatusBadRequest, e.Error())
}

// authenticate answers 401 and returns false unless r has a valid token,
// and 403 unless the token holds role (the route's) for some tenant; it
// returns the principal acting in role.
func (h *Handler) authenticate(w http.ResponseWriter, r *http.Request, role auth.Roles) (auth.Principal, bool) {
	p, ok := h.tokens.Authenticate(r)
	if !ok {
		writeError(w, http.StatusUnauthorized, "authorization: missing or invalid bearer token")
		return p, false
	}
	p = p.As(role)
	if !p.Allowed() {
		forbidden(w)
		return p, false
	}
	return p, true
}

// forbidden answers 403 with one message for every reason (role, tenant or
// plan), so that a caller learns nothing about what its token lacks.
func forbidden(w http.ResponseWriter) {
	writeError(w, http.StatusForbidden, "authorization: this token does not allow this request")
}

// authorize answers 403 and returns false unless p may act for tenant.
func authorize(w http.ResponseWriter, p auth.Principal, tenant string) bool {
	if ok, _ := p.For(tenant); !ok {
		forbidden(w)
		return false
	}
	return true
}

// authorizePlan answers 403 and returns false unless p may act for tenant
// on plan (auth.Principal.NamesPlan).
func authorizePlan(w http.ResponseWriter, p auth.Principal, pol *policy.Policy, tenant, plan string) bool {
	if !p.NamesPlan(pol, tenant, plan) {
		forbidden(w)
		return false
	}
	return true
}

// readBody reads at most MaxBodyBytes, answering 413 for more: at once when
// Content-Length says so, else as soon as the limit is passed.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	if r.ContentLength > MaxBodyBytes {
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body: larger than %d bytes", MaxBodyBytes))
		return nil, false
	}
	var b []byte
	var err error
	if r.ContentLength >= 0 {
		// net/http ends the body at its Content-Length: one allocation of
		// that size, not io.ReadAll's 512 bytes and more.
		b = make([]byte, r.ContentLength)
		_, err = io.ReadFull(r.Body, b)
	} else {
		b, err = io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	}
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body: larger than %d bytes", MaxBodyBytes))
		} else {
			writeError(w, http.StatusBadRequest, "body: could not be read")
		}
		return nil, false
	}
	// Read to its end, the body closes at no cost; closed, it spares every
	// POST net/http's own attempt to drain it after the handler (an
	// io.LimitedReader and a pooled 8 KiB copy that finds nothing).
	_ = r.Body.Close()
	return b, true
}

// newRequestID returns a random request id (26 base32 characters, 130
// bits).
func newRequestID() string { return rand.Text() }

// clientError reports whether a Decider error is the caller's fault, and
// the 400 message.
func clientError(err error, plan string) (string, bool) {
	switch {
	case errors.Is(err, policy.ErrUnknownPlan):
		return fmt.Sprintf("plan: %q is not a plan of the policy", plan), true
	case errors.Is(err, limits.ErrInvalid):
		msg := err.Error()
		if i := strings.LastIndex(msg, limits.ErrInvalid.Error()+": "); i >= 0 {
			msg = msg[i+len(limits.ErrInvalid.Error())+2:]
		}
		return msg, true
	}
	return "", false
}

// canceled reports whether err is only the client going away (ctx is
// the request's).
func canceled(ctx context.Context, err error) bool {
	return ctx.Err() != nil && errors.Is(err, context.Canceled)
}
