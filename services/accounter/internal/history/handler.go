package history

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	"quotaflow/internal/auth"
)

// Options configure a Handler.
type Options struct {
	// Reader runs the queries.
	Reader *Reader
	// Auth checks the tokens; nil is no authentication (every request reads
	// every tenant: listen on loopback only).
	Auth *auth.Auth
	// Pages serves every path outside /v1/: the console's pages and assets.
	// Nil answers them 404.
	Pages http.Handler
	// Log receives the queries that failed (never a token).
	Log *slog.Logger
}

// Handler serves the usage API under /v1/ and Options.Pages elsewhere.
type Handler struct {
	o   Options
	mux *http.ServeMux
}

// NewHandler returns the console's handler.
func NewHandler(o Options) *Handler {
	if o.Pages == nil {
		o.Pages = http.NotFoundHandler()
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	h := &Handler{o: o, mux: http.NewServeMux()}
	h.mux.HandleFunc("GET /v1/usage/history", h.history)
	h.mux.HandleFunc("GET /v1/usage/top", h.top)
	h.mux.HandleFunc("GET /v1/usage/denials", h.denials)
	h.mux.HandleFunc("GET /v1/usage/windows", h.windows)
	h.mux.HandleFunc("GET /v1/usage/near", h.near)
	h.mux.HandleFunc("GET /v1/alerts", h.alerts)
	h.mux.HandleFunc("GET /v1/tenants", h.tenants)
	h.mux.HandleFunc("/v1/", func(w http.ResponseWriter, r *http.Request) {
		problem(w, http.StatusNotFound, "no such API path")
	})
	h.mux.Handle("/", o.Pages)
	return h
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

// viewer authenticates r, or answers it 401 and returns false.
func (h *Handler) viewer(w http.ResponseWriter, r *http.Request) (Viewer, bool) {
	v, ok := Authenticate(h.o.Auth, r)
	if !ok {
		w.Header().Set("WWW-Authenticate", `Bearer realm="quotaflow console"`)
		problem(w, http.StatusUnauthorized, "a known token is required (Authorization: Bearer, or the console's cookie)")
	}
	return v, ok
}

// tenant authenticates r and returns the tenant its "tenant" parameter
// names, or answers the request (401, 400, 403) and returns false.
func (h *Handler) tenant(w http.ResponseWriter, r *http.Request) (Tenant, bool) {
	v, ok := h.viewer(w, r)
	if !ok {
		return Tenant{}, false
	}
	t, err := v.Tenant(r.URL.Query().Get("tenant"))
	if err != nil {
		h.fail(w, err)
		return Tenant{}, false
	}
	return t, true
}

// history answers GET /v1/usage/history?tenant=&user=&from=&to=&step=.
func (h *Handler) history(w http.ResponseWriter, r *http.Request) {
	t, ok := h.tenant(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	rg, err := ParseRange(q, Hour)
	if err != nil {
		h.fail(w, err)
		return
	}
	points, err := h.o.Reader.History(r.Context(), t, q.Get("user"), rg)
	if err != nil {
		h.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Points []Point `json:"points"`
	}{points})
}

// fail answers err: 400 for a bad parameter, 403 for a tenant the token
// may not read, 503 for alerts kept elsewhere or Redis unread (logged),
// else 500 (logged; its text stays in the log).
func (h *Handler) fail(w http.ResponseWriter, err error) {
	var pe *ParamError
	switch {
	case errors.As(err, &pe):
		problem(w, http.StatusBadRequest, pe.Error())
	case errors.Is(err, ErrForbidden):
		problem(w, http.StatusForbidden, err.Error())
	case errors.Is(err, ErrNoAlerts):
		problem(w, http.StatusServiceUnavailable, err.Error())
	case errors.Is(err, ErrRedis):
		h.o.Log.Error("console read of Redis failed", "err", err)
		problem(w, http.StatusServiceUnavailable, ErrRedis.Error()+"; try again")
	default:
		h.o.Log.Error("console query failed", "err", err)
		problem(w, http.StatusInternalServerError, "the query failed; see the accounter's log")
	}
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// problem writes an RFC 9457 problem.
func problem(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(struct {
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{http.StatusText(status), status, detail})
}
