package console

import (
	"bytes"
	"encoding/json"
	"errors"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/pkg/ident"
)

// page is what every template gets: the layout's fields and one page's
// data.
type page struct {
	Title    string
	Tenant   string // the tenant the page is about; empty above tenants
	Nav      string // the tenant page shown, for aria-current
	SignedIn bool
	Error    string
	NotAvail bool // the page's data has no source yet (ErrNotAvailable)
	Range    span
	Ranges   []span
	User     string

	Tenants   []string
	Subjects  Subjects
	Threshold int    // the near page's percentage
	NextPage  string // the URL of the tenants' or users' next page; empty on the last
	Points    []Point
	Chart     string // the chart's points, as JSON for uPlot
	From      int64  // the chart's range, in seconds since the epoch
	To        int64
	Top       []UserTotal
	Denials   []Denial
	Alerts    []Alert
}

// span is a range a tenant page can show: the last Length, in steps of
// Step.
type span struct {
	Name   string
	Length time.Duration
	Step   Step
}

// spans are the ranges the pages offer; the first is the default. A fixed
// set keeps every query bounded.
var spans = []span{
	{"24h", 24 * time.Hour, Hour},
	{"7d", 7 * 24 * time.Hour, Day},
	{"30d", 30 * 24 * time.Hour, Day},
}

// topLimit and alertLimit bound the top users and recent alerts shown.
const (
	topLimit   = 20
	alertLimit = 50
)

// defaultThreshold is the near page's percentage when the URL names none:
// the alerter's first default threshold.
const defaultThreshold = 80

// badParam is a page's invalid query parameter, answered 400 with its
// text.
type badParam string

func (e badParam) Error() string { return string(e) }

var funcs = template.FuncMap{
	"rank":   func(i int) int { return i + 1 },
	"tenant": tenantPath,
	"utc": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
}

// render writes the named page, or a plain 500 when it fails, so a half
// page is never sent.
func (h *Handler) render(w http.ResponseWriter, r *http.Request, code int, name string, p page) {
	var b bytes.Buffer
	if err := pages.ExecuteTemplate(&b, name, p); err != nil {
		h.log.Error("console: render", "page", name, "err", err)
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	w.Write(b.Bytes())
}

// fail answers a request whose source call failed: 400 for a bad
// parameter, else 503, the error page saying why when the source said
// (SourceDown).
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, p page, err error) {
	if errors.Is(err, ErrUnknownPlan) {
		err = badParam("Unknown plan: choose one of the list.")
	}
	if bp, ok := errors.AsType[badParam](err); ok {
		p.Error = string(bp)
		h.render(w, r, http.StatusBadRequest, "error", p)
		return
	}
	h.log.Error("console: read", "path", r.URL.Path, "err", err)
	p.Error = "The ledger or Redis could not be read; try again."
	if sd, ok := errors.AsType[*SourceDown](err); ok {
		p.Error = sd.Why
	}
	h.render(w, r, http.StatusServiceUnavailable, "error", p)
}

// home lists the tenants an admin may see, a page at a time (after
// ?after); a token bound to one tenant goes straight to its users.
func (h *Handler) home(w http.ResponseWriter, r *http.Request, pr auth.Principal) {
	p := page{Title: "Tenants", SignedIn: true}
	if !pr.ReadsAll() {
		if ts := pr.Tenants(); len(ts) == 1 {
			http.Redirect(w, r, tenantPath(ts[0], ""), http.StatusSeeOther)
			return
		}
		p.Tenants = pr.Tenants()
		h.render(w, r, http.StatusOK, "tenants", p)
		return
	}
	after := r.URL.Query().Get("after")
	if ident.Check(after) != nil {
		h.fail(w, r, p, badParam("Invalid page."))
		return
	}
	ts, err := h.src.Tenants(r.Context(), after)
	if err != nil {
		h.fail(w, r, p, err)
		return
	}
	p.Tenants = ts.Tenants
	if ts.Next != "" {
		p.NextPage = "/?" + url.Values{"after": {ts.Next}}.Encode()
	}
	h.render(w, r, http.StatusOK, "tenants", p)
}

// show returns the tenant page name (its template and tab): read fills
// its data; a ranged page first reads its ?range (and the usage page its
// ?user), answering 400 itself when one is invalid.
func (h *Handler) show(name string, ranged bool, read func(r *http.Request, p *page, from, to time.Time) error) func(http.ResponseWriter, *http.Request, page) {
	return func(w http.ResponseWriter, r *http.Request, p page) {
		p.Nav = name
		var from, to time.Time
		if ranged {
			var ok bool
			if from, to, ok = h.withRange(w, r, &p); !ok {
				return
			}
		}
		err := read(r, &p, from, to)
		if errors.Is(err, ErrNotAvailable) {
			p.NotAvail, err = true, nil
		}
		if err != nil {
			h.fail(w, r, p, err)
			return
		}
		h.render(w, r, http.StatusOK, name, p)
	}
}

// readUsers reads a page of a tenant's users (after ?after) with each
// limit's window.
func (h *Handler) readUsers(r *http.Request, p *page, _, _ time.Time) error {
	after := r.URL.Query().Get("after")
	if ident.Check(after) != nil {
		return badParam("Invalid page.")
	}
	plan, err := pagePlan(r)
	if err != nil {
		return err
	}
	s, err := h.src.Users(r.Context(), p.Tenant, plan, after)
	p.setSubjects(s, "", url.Values{"plan": {plan}})
	return err
}

// pagePlan reads a subjects page's ?plan: empty is the tenant's own.
func pagePlan(r *http.Request) (string, error) {
	plan := r.URL.Query().Get("plan")
	if ident.Check(plan) != nil {
		return "", badParam("Invalid plan.")
	}
	return plan, nil
}

// readNear reads a page of a tenant's subjects at ?threshold percent of a
// limit or more.
func (h *Handler) readNear(r *http.Request, p *page, _, _ time.Time) error {
	q := r.URL.Query()
	p.Threshold = defaultThreshold
	if v := q.Get("threshold"); v != "" {
		var err error
		if p.Threshold, err = strconv.Atoi(v); err != nil || p.Threshold < 1 || p.Threshold > 100 {
			return badParam("The threshold is a percentage, 1 to 100.")
		}
	}
	after := q.Get("after")
	if ident.Check(after) != nil {
		return badParam("Invalid page.")
	}
	plan, err := pagePlan(r)
	if err != nil {
		return err
	}
	s, err := h.src.Near(r.Context(), p.Tenant, plan, p.Threshold, after)
	p.setSubjects(s, "/near", url.Values{"plan": {plan}, "threshold": {strconv.Itoa(p.Threshold)}})
	return err
}

// setSubjects shows s, with a link to its next page: the tenant's page
// sub, with query next (an empty plan left out) and s.Next.
func (p *page) setSubjects(s Subjects, sub string, next url.Values) {
	p.Subjects = s
	if next.Get("plan") == "" {
		next.Del("plan")
	}
	if s.Next != "" {
		next.Set("after", s.Next)
		p.NextPage = tenantPath(p.Tenant, sub) + "?" + next.Encode()
	}
}

// withRange reads the page's ?range (and ?user for usage), answering 400
// itself when one is invalid.
func (h *Handler) withRange(w http.ResponseWriter, r *http.Request, p *page) (from, to time.Time, ok bool) {
	p.Ranges = spans
	p.Range = spans[0]
	if q := r.URL.Query().Get("range"); q != "" {
		found := false
		for _, s := range spans {
			if s.Name == q {
				p.Range, found = s, true
			}
		}
		if !found {
			p.Error = "Unknown range: choose one of the list."
			h.render(w, r, http.StatusBadRequest, "error", *p)
			return from, to, false
		}
	}
	p.User = r.URL.Query().Get("user")
	if ident.Check(p.User) != nil {
		p.Error = "Invalid user."
		h.render(w, r, http.StatusBadRequest, "error", *p)
		return from, to, false
	}
	to = h.now().UTC()
	if p.Range.Step == Day {
		to = to.Truncate(24 * time.Hour).Add(24 * time.Hour)
	} else {
		to = to.Truncate(time.Hour).Add(time.Hour)
	}
	return to.Add(-p.Range.Length), to, true
}

// readUsage reads a tenant's (or one user's) tokens and requests over
// time, for the chart and its table.
func (h *Handler) readUsage(r *http.Request, p *page, from, to time.Time) error {
	pts, err := h.src.History(r.Context(), p.Tenant, p.User, from, to, p.Range.Step)
	if err != nil {
		return err
	}
	p.Points = pts
	// uPlot takes columns: seconds since the epoch, then each series.
	cols := [3][]int64{{}, {}, {}}
	for _, pt := range pts {
		cols[0] = append(cols[0], pt.Start.Unix())
		cols[1] = append(cols[1], pt.Tokens)
		cols[2] = append(cols[2], pt.Requests)
	}
	js, _ := json.Marshal(cols) // integers only: cannot fail
	p.Chart, p.From, p.To = string(js), from.Unix(), to.Unix()
	return nil
}

// readTop reads a tenant's heaviest users over the range.
func (h *Handler) readTop(r *http.Request, p *page, from, to time.Time) (err error) {
	p.Top, err = h.src.TopUsers(r.Context(), p.Tenant, from, to, topLimit)
	return err
}

// readDenials counts a tenant's denied requests by limit over the range.
func (h *Handler) readDenials(r *http.Request, p *page, from, to time.Time) (err error) {
	p.Denials, err = h.src.Denials(r.Context(), p.Tenant, from, to)
	return err
}

// readAlerts reads a tenant's most recent alerts.
func (h *Handler) readAlerts(r *http.Request, p *page, _, _ time.Time) (err error) {
	p.Alerts, err = h.src.Alerts(r.Context(), p.Tenant, alertLimit)
	return err
}
