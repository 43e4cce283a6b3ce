package alertlog

import (
	"log/slog"
	"net/http"
	"strconv"

	"quotaflow/internal/auth"
	"quotaflow/internal/server"
	"quotaflow/pkg/ident"
)

// NewHandler returns the alerter's API: GET /v1/alerts?tenant=&limit=&offset=
// answers a List of tenant's alerts in db. Requests are authenticated by
// tokens ("Authorization: Bearer"), the tokens admission and the accounter
// accept, and read as the console's usage API reads: an admin token reads
// every tenant, a token bound to tenant reads it, any other is refused
// (403, whether or not the tenant has alerts). A nil tokens is no
// authentication: serve it on loopback only. Failed queries are logged to
// log (nil: discarded), never a token; a query its caller gave up on
// (the accounter's QF_ALERTER_TIMEOUT) at Debug.
func NewHandler(db Querier, tokens *auth.Auth, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/alerts", func(w http.ResponseWriter, r *http.Request) {
		p, ok := tokens.Authenticate(r)
		if !ok {
			w.Header().Set("WWW-Authenticate", `Bearer realm="quotaflow alerter"`)
			server.Problem(w, http.StatusUnauthorized, "a known token is required (Authorization: Bearer)")
			return
		}
		q := r.URL.Query()
		tenant := q.Get("tenant")
		if tenant == "" {
			server.Problem(w, http.StatusBadRequest, "tenant: required")
			return
		}
		if err := ident.Check(tenant); err != nil {
			server.Problem(w, http.StatusBadRequest, "tenant: "+err.Error())
			return
		}
		if !p.Reads(tenant) {
			server.Problem(w, http.StatusForbidden, "this token may not read that tenant")
			return
		}
		limit, ok := param(w, q.Get("limit"), "limit", DefaultLimit, 1, MaxLimit)
		if !ok {
			return
		}
		offset, ok := param(w, q.Get("offset"), "offset", 0, 0, MaxOffset)
		if !ok {
			return
		}
		as, err := Recent(r.Context(), db, tenant, limit, offset)
		if err != nil && r.Context().Err() != nil {
			log.Debug("alerts query given up by its caller", "err", err)
			return
		}
		if err != nil {
			log.Error("alerts query failed", "err", err)
			server.Problem(w, http.StatusInternalServerError, "the query failed; see the alerter's log")
			return
		}
		if as == nil {
			as = []Alert{} // [], not null
		}
		server.JSON(w, http.StatusOK, List{as})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		server.Problem(w, http.StatusNotFound, "no such API path")
	})
	return mux
}

// param reads an integer parameter in [lo, hi] (def when absent), or
// answers 400 naming it and returns false.
func param(w http.ResponseWriter, v, name string, def, lo, hi int) (int, bool) {
	if v == "" {
		return def, true
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		server.Problem(w, http.StatusBadRequest, name+": want "+strconv.Itoa(lo)+" to "+strconv.Itoa(hi))
		return 0, false
	}
	return n, true
}
