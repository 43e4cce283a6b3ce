// Package console is the accounter's web console: server-rendered pages
// (html/template) and their assets, embedded in the binary, served at / on
// the console listener beside the usage history API.
//
// A browser signs in by posting a token once to /signin; the console keeps
// it in an HttpOnly, SameSite=Strict cookie (Secure when the request came
// over TLS) that the pages and the history API both accept. /signout
// clears it. Every page asks the token's auth.Principal which tenants it
// reads (auth.Principal.Reads) and shows nothing else: an admin token
// starts at the list of tenants, a tenant-bound token at its tenant's
// users, and a tenant in the URL that the token may not read answers 404,
// the same as one that does not exist. A token that reads no tenant (a
// platform gateway's, for every tenant but not admin) cannot sign in.
//
// The pages make no request to another origin: the Content-Security-Policy
// allows only the console's own scripts, styles and images, and the chart
// (uPlot 1.6.32, MIT, vendored under static/) reads its points from a JSON
// block in the page rather than from a script or a request.
package console

import (
	"context"
	"embed"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/services/accounter/internal/history"
)

// CookieName is the cookie that carries the signed-in token: the usage
// history API's, which accepts it too.
const CookieName = history.CookieName

// ErrNotAvailable is a Source's answer for data it has no source of yet;
// the page says so rather than show numbers.
var ErrNotAvailable = errors.New("not available")

// ErrUnknownPlan is a Source's answer for a plan the policy does not
// define, or the viewer may not read: the page answers 400.
var ErrUnknownPlan = errors.New("unknown plan")

// principalKey and authorizationKey key the signed-in token's
// auth.Principal and the token itself in a request's context.
type (
	principalKey     struct{}
	authorizationKey struct{}
)

// Principal returns the signed-in token's principal that the page calling
// a Source runs for, so the Source can check its tenant again.
func Principal(ctx context.Context) (auth.Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(auth.Principal)
	return p, ok
}

// Authorization returns the signed-in token as an Authorization header's
// value, for a Source that reads from another service with the viewer's
// own token (the alerter's API).
func Authorization(ctx context.Context) string {
	a, _ := ctx.Value(authorizationKey{}).(string)
	return a
}

// SourceDown is a Source's error when the service it reads from does not
// answer: the page says Why (no secret, no internal detail), with a 503.
type SourceDown struct {
	Why string
	Err error // logged
}

func (e *SourceDown) Error() string { return e.Why + ": " + e.Err.Error() }
func (e *SourceDown) Unwrap() error { return e.Err }

// Tokens authenticates a bare token, as the cookie carries it
// (*auth.Auth; nil there is no authentication: the console then listens on
// loopback only).
type Tokens interface {
	AuthenticateToken(tok string) (auth.Principal, bool)
}

// Source reads what the pages show. Each call is for one tenant the
// caller has checked the token may see (its context holds the token's
// Principal); lists are bounded by the source.
type Source interface {
	Tenants(ctx context.Context, after string) (Tenants, error)
	Users(ctx context.Context, tenant, plan, after string) (Subjects, error)
	Near(ctx context.Context, tenant, plan string, threshold int, after string) (Subjects, error)
	History(ctx context.Context, tenant, user string, from, to time.Time, step Step) ([]Point, error)
	TopUsers(ctx context.Context, tenant string, from, to time.Time, limit int) ([]UserTotal, error)
	Denials(ctx context.Context, tenant string, from, to time.Time) ([]Denial, error)
	Alerts(ctx context.Context, tenant string, limit int) ([]Alert, error)
}

// Tenants is one page of the tenants an admin reads, in order. Next is the
// tenant the next page starts after, "" on the last page.
type Tenants struct {
	Tenants []string
	Next    string
}

// Step is the width of a history point.
type Step string

// The steps History takes.
const (
	Hour Step = "hour"
	Day  Step = "day" // a UTC day
)

// Subjects is one page of a tenant's subjects on Plan, in order of user:
// Tenant holds the tenant-wide limits (on the first page), Users each
// user's own. Plans are the plans the tenant's requests can name, its own
// first. Next is the user the next page starts after, "" on the last page.
type Subjects struct {
	Plan   string
	Plans  []string
	Tenant []Window
	Users  []User
	Next   string
}

// User is one user of a tenant and the windows of its own limits, or
// Error, why they could not be read.
type User struct {
	User    string
	Windows []Window
	Error   string
}

// Window is one limit's current window for a subject.
type Window struct {
	Name      string // the limit's scope and name: "user daily"
	Limit     int64
	Used      int64
	Remaining int64
	Reset     time.Time // when the window next frees capacity or resets; zero where none is given (history.Window.Reset)
}

// Point is the usage of one step starting at Start.
type Point struct {
	Start    time.Time
	Tokens   int64
	Requests int64
}

// UserTotal is one user's usage over a range.
type UserTotal struct {
	User     string
	Tokens   int64
	Requests int64
}

// Denial counts the requests one limit denied over a range.
type Denial struct {
	Limit string
	Count int64
}

// Alert is one alert the alerter raised.
type Alert struct {
	At        time.Time
	User      string
	Kind      string
	Limit     string
	Threshold int // percent; 0 when the alert is not a threshold's
}

// Options configure a Handler.
type Options struct {
	Auth   Tokens
	Source Source
	Log    *slog.Logger
	// Now returns the time the pages' ranges end at; default time.Now.
	Now func() time.Time
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// pages holds every page's template, each with the shared layout.
var pages = template.Must(template.New("").Funcs(funcs).ParseFS(templateFS, "templates/*.html"))

// Handler serves the console's pages and assets.
type Handler struct {
	auth Tokens
	src  Source
	log  *slog.Logger
	now  func() time.Time
	mux  *http.ServeMux
}

// New returns the console's handler, to be mounted at / of the console
// listener.
func New(o Options) *Handler {
	h := &Handler{auth: o.Auth, src: o.Source, log: o.Log, now: o.Now}
	if h.now == nil {
		h.now = time.Now
	}
	static, _ := fs.Sub(staticFS, "static") // a constant path: cannot fail
	h.mux = http.NewServeMux()
	h.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	h.mux.HandleFunc("GET /signin", h.signinForm)
	h.mux.HandleFunc("POST /signin", h.signin)
	h.mux.HandleFunc("POST /signout", h.signout)
	h.mux.HandleFunc("GET /{$}", h.signedIn(h.home))
	h.mux.HandleFunc("GET /tenants/{tenant}", h.tenantPage(h.show("users", false, h.readUsers)))
	h.mux.HandleFunc("GET /tenants/{tenant}/near", h.tenantPage(h.show("near", false, h.readNear)))
	h.mux.HandleFunc("GET /tenants/{tenant}/usage", h.tenantPage(h.show("usage", true, h.readUsage)))
	h.mux.HandleFunc("GET /tenants/{tenant}/top", h.tenantPage(h.show("top", true, h.readTop)))
	h.mux.HandleFunc("GET /tenants/{tenant}/denials", h.tenantPage(h.show("denials", true, h.readDenials)))
	h.mux.HandleFunc("GET /tenants/{tenant}/alerts", h.tenantPage(h.show("alerts", false, h.readAlerts)))
	return h
}

// csp allows the console's own scripts, styles and images and nothing
// else: no inline script or style, no other origin, no framing.
const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// ServeHTTP sets the security headers every answer carries and routes r.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", csp)
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("X-Frame-Options", "DENY")
	h.mux.ServeHTTP(w, r)
}
