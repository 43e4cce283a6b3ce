package history

import (
	"net/http"
	"net/url"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/server"
)

// rangedPage authenticates r, and reads its tenant, range (rounded to
// hours) and page, or answers the request and returns false.
func (h *Handler) rangedPage(w http.ResponseWriter, r *http.Request) (Tenant, Range, Page, bool) {
	t, ok := h.tenant(w, r)
	if !ok {
		return t, Range{}, Page{}, false
	}
	q := r.URL.Query()
	rg, err := ParseRange(q, Hour)
	if err == nil && q.Get("step") != "" {
		err = &ParamError{"step", "not a parameter of this list"}
	}
	var p Page
	if err == nil {
		p, err = ParsePage(q)
	}
	if err != nil {
		h.fail(w, err)
		return t, rg, p, false
	}
	return t, rg, p, true
}

// top answers GET /v1/usage/top?tenant=&from=&to=&limit=&offset=.
func (h *Handler) top(w http.ResponseWriter, r *http.Request) {
	t, rg, p, ok := h.rangedPage(w, r)
	if !ok {
		return
	}
	users, err := h.o.Reader.TopUsers(r.Context(), t, rg.From, rg.To, p)
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, struct {
		Users []UserTotal `json:"users"`
	}{nonNil(users)})
}

// denials answers GET /v1/usage/denials?tenant=&from=&to=&limit=&offset=.
func (h *Handler) denials(w http.ResponseWriter, r *http.Request) {
	t, rg, p, ok := h.rangedPage(w, r)
	if !ok {
		return
	}
	ds, err := h.o.Reader.Denials(r.Context(), t, rg.From, rg.To, p)
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, struct {
		Denials []Denial `json:"denials"`
	}{nonNil(ds)})
}

// alerts answers GET /v1/alerts?tenant=&limit=&offset=.
func (h *Handler) alerts(w http.ResponseWriter, r *http.Request) {
	t, ok := h.tenant(w, r)
	if !ok {
		return
	}
	p, err := ParsePage(r.URL.Query())
	if err != nil {
		h.fail(w, err)
		return
	}
	as, err := h.o.Alerts.Alerts(r.Context(), Authorization(r), t, p)
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, alertlog.List{Alerts: nonNil(as)})
}

// tenants answers GET /v1/tenants?after=&limit=: every tenant of the
// ledger for an admin, a page at a time; the token's own tenants else.
func (h *Handler) tenants(w http.ResponseWriter, r *http.Request) {
	v, ok := h.viewer(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	p, err := afterPage(q)
	if err != nil {
		h.fail(w, err)
		return
	}
	ts, err := h.o.Reader.Tenants(r.Context(), v, q.Get("after"), p.Limit)
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, struct {
		Tenants []string `json:"tenants"`
	}{nonNil(ts)})
}

// afterPage reads the limit of a list paged by after, which takes no
// offset.
func afterPage(q url.Values) (Page, error) {
	p, err := ParsePage(q)
	if err == nil && p.Offset != 0 {
		err = &ParamError{"offset", "not a parameter of this list: page with after"}
	}
	return p, err
}

// nonNil makes an empty list encode as [], not null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// windows answers GET /v1/usage/windows?tenant=&user=&plan=.
func (h *Handler) windows(w http.ResponseWriter, r *http.Request) {
	t, ok := h.tenant(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	sw, err := h.o.Reader.Windows(r.Context(), t, q.Get("user"), q.Get("plan"))
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, sw)
}

// near answers GET /v1/usage/near?tenant=&plan=&threshold=&limit=&after=.
func (h *Handler) near(w http.ResponseWriter, r *http.Request) {
	t, ok := h.tenant(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	threshold, err := ParseThreshold(q)
	var p Page
	if err == nil {
		p, err = afterPage(q)
	}
	if err != nil {
		h.fail(w, err)
		return
	}
	page, err := h.o.Reader.Near(r.Context(), t, q.Get("plan"), threshold, q.Get("after"), p.Limit)
	if err != nil {
		h.fail(w, err)
		return
	}
	server.JSON(w, http.StatusOK, page)
}
