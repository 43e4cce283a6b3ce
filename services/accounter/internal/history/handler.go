package history

import (
	"errors"
	"log/slog"
	"net/http"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/auth"
	"quotaflow/internal/server"
)

// Options configure a Handler.
type Options struct {
	// Reader runs the queries.
	Reader *Reader
	// Alerts reads the recent alerts; nil is Reader (the alerter's outbox
	// in the ledger's database).
	Alerts AlertSource
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
	if o.Alerts == nil {
		o.Alerts = o.Reader
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
		server.Problem(w, http.StatusNotFound, "no such API path")
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
		server.Problem(w, http.StatusUnauthorized, "a known token is required (Authorization: Bearer, or the console's cookie)")
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
	server.JSON(w, http.StatusOK, struct {
		Points []Point `json:"points"`
	}{points})
}

// fail answers err: 400 for a bad parameter, 403 for a tenant the token
// may not read, 503 for alerts kept elsewhere, an alerter that does not
// answer, Redis unread (logged) or busy (with Retry-After), a read of the
// ledger past its timeout (logged), 502 for the alerter's refusal or a bad
// answer (its reason said), else 500 (logged; its text stays in the log).
func (h *Handler) fail(w http.ResponseWriter, err error) {
	var pe *ParamError
	switch {
	case errors.As(err, &pe):
		server.Problem(w, http.StatusBadRequest, pe.Error())
	case errors.Is(err, ErrForbidden):
		server.Problem(w, http.StatusForbidden, err.Error())
	case errors.Is(err, alertlog.ErrNoOutbox):
		server.Problem(w, http.StatusServiceUnavailable, "the alerter's outbox is not in the accounter's database and QF_ALERTER_URL is not set")
	case errors.Is(err, alertlog.ErrUnreachable):
		h.o.Log.Error("alerter not reachable", "err", err)
		server.Problem(w, http.StatusServiceUnavailable, "the alerter (QF_ALERTER_URL) cannot be reached; see the accounter's log")
	case errors.Is(err, alertlog.ErrBadAnswer):
		server.Problem(w, http.StatusBadGateway, err.Error())
	case errors.Is(err, ErrBusy):
		w.Header().Set("Retry-After", "1")
		server.Problem(w, http.StatusServiceUnavailable, ErrBusy.Error()+"; try again in a second")
	case errors.Is(err, ErrTimeout):
		h.o.Log.Warn("console read of the ledger timed out", "err", err)
		server.Problem(w, http.StatusServiceUnavailable, ErrTimeout.Error()+"; try a shorter range, or again later")
	case errors.Is(err, ErrRedis):
		h.o.Log.Error("console read of Redis failed", "err", err)
		server.Problem(w, http.StatusServiceUnavailable, ErrRedis.Error()+"; try again")
	default:
		h.o.Log.Error("console query failed", "err", err)
		server.Problem(w, http.StatusInternalServerError, "the query failed; see the accounter's log")
	}
}
