package history

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Peeker reads subjects' limits in Redis without changing them
// (*limits.Limiter).
type Peeker interface {
	PeekBatch(ctx context.Context, rs []limits.Request) []limits.Reserved
}

// ErrBusy is a read of windows refused because MaxPeeks reads are under
// way. Handlers answer it with 503 and Retry-After.
var ErrBusy = errors.New("too many reads of the windows in Redis at once")

// ErrRedis wraps a failed read of Redis (down, or lost its data and not yet
// rebuilt). Handlers answer it with 503.
var ErrRedis = errors.New("the windows in Redis could not be read")

// WindowsSource is where a Reader reads windows: the Limiter and the
// current policy, which resolves a subject's plan as admission's GET
// /v1/usage does (plan=, else the tenant's plan, else default_plan).
type WindowsSource struct {
	Limiter Peeker
	Policy  func() *policy.Policy
	// MaxPeeks is how many reads of windows (a user's, or a page's) may
	// run at once; one more fails with ErrBusy. 0 is DefaultMaxPeeks.
	MaxPeeks int
}

// DefaultMaxPeeks bounds the Redis time the console's readers can take
// from admission, which decides on the same single-threaded Redis: a page
// of 500 users is 8 script calls of about 0.6 ms each (bench/results.md),
// and a tenant's token may ask for pages in a loop.
const DefaultMaxPeeks = 2

// Window is one limit of a subject as Redis holds it now: Used of Limit
// (for a balance, the credits topped up so far), Remaining, and Reset, when
// it next frees capacity or resets: nil where the engine gives none (a
// balance, a concurrency limit, a rolling, sliding-log or token-bucket
// limit holding nothing). Endpoint names the endpoint of a per-user limit
// of an endpoint (scope user), which admission enforces only on requests
// to that endpoint.
type Window struct {
	Scope     policy.Scope `json:"scope"`
	Endpoint  string       `json:"endpoint,omitempty"`
	Name      string       `json:"name"`
	Kind      policy.Kind  `json:"kind"`
	Unit      policy.Unit  `json:"unit"`
	Limit     int64        `json:"limit"`
	Used      int64        `json:"used"`
	Remaining int64        `json:"remaining"`
	Reset     *time.Time   `json:"reset"`
	Shadow    bool         `json:"shadow,omitempty"`
}

// near reports whether w is at threshold percent of its limit or more.
func (w *Window) near(threshold int) bool {
	return w.Limit > 0 && w.Used*100 >= int64(threshold)*w.Limit // both ≤ 1e12: no overflow
}

// SubjectWindows is every limit of one subject, tenant-wide ones first.
type SubjectWindows struct {
	User    string    `json:"user"`
	Plan    string    `json:"plan"`
	Now     time.Time `json:"now"` // Redis time of the read
	Windows []Window  `json:"windows"`
	err     string    // why the user's windows could not be read (peek)
}

// Windows returns every limit of t's user on plan (empty: the tenant's
// own) in the current policy, as Redis holds them now: its tenant-wide and
// user limits, as admission's GET /v1/usage, then every endpoint's per-user
// limits, which that answer leaves out.
func (rd *Reader) Windows(ctx context.Context, t Tenant, user, plan string) (SubjectWindows, error) {
	if err := checkID("user", user, true); err != nil {
		return SubjectWindows{}, err
	}
	res, err := rd.rules(t, plan)
	if err != nil {
		return SubjectWindows{}, err
	}
	rs, err := rd.peek(ctx, t, res, []string{user})
	if err != nil {
		return SubjectWindows{}, err
	}
	if rs[0].err != "" {
		return SubjectWindows{}, &ParamError{"user", rs[0].err}
	}
	return rs[0], nil
}

// Plans lists the plans t's own token may read (policy.Policy.TenantPlans),
// its own first: the plans its users' requests can name.
func (rd *Reader) Plans(t Tenant) []string { return rd.windows.Policy().TenantPlans(t.name) }

// rules resolves the limits of t's subjects on plan, after checking that
// t's viewer may name it as admission checks a request's plan: a token
// bound to t only the plans the policy grants t (else ErrForbidden), an
// admin any plan of the policy. Subject holds the tenant-wide and user
// limits, then the per-user limits of every endpoint, in order of path.
func (rd *Reader) rules(t Tenant, plan string) (policy.Resolved, error) {
	if err := checkID("plan", plan, false); err != nil {
		return policy.Resolved{}, err
	}
	pol := rd.windows.Policy()
	if !t.p.NamesPlan(pol, t.name, plan) {
		return policy.Resolved{}, ErrForbidden
	}
	res, err := pol.Resolve(t.name, plan, "")
	if errors.Is(err, policy.ErrUnknownPlan) {
		return policy.Resolved{}, &ParamError{"plan", "not a plan of the policy"}
	} else if err != nil {
		return policy.Resolved{}, fmt.Errorf("windows of %s: %w", t.name, err)
	}
	rules := slices.Clone(res.Subject) // Resolve's are shared
	for _, path := range slices.Sorted(maps.Keys(pol.Endpoints)) {
		if e := pol.Endpoints[path]; e == nil || len(e.User) == 0 {
			continue
		}
		er, err := pol.Resolve(t.name, plan, path)
		if err != nil {
			return policy.Resolved{}, fmt.Errorf("windows of %s on %s: %w", t.name, path, err)
		}
		for _, r := range er.Subject {
			if r.Endpoint != "" {
				rules = append(rules, r)
			}
		}
	}
	res.Subject = rules
	return res, nil
}

// peek reads the windows of t's users under res, in one pipelined round
// trip. A user whose windows could not be read has err set and no
// windows, so that one user cannot fail every page it is on: one the
// Limiter refuses (limits.ErrInvalid: an identifier admission would not
// accept, written before a rule changed), or whose state alone could not
// be read. When no user could be read it is ErrRedis.
func (rd *Reader) peek(ctx context.Context, t Tenant, res policy.Resolved, users []string) ([]SubjectWindows, error) {
	select {
	case rd.peeks <- struct{}{}:
		defer func() { <-rd.peeks }()
	default:
		return nil, ErrBusy
	}
	reqs := make([]limits.Request, len(users))
	for i, u := range users {
		reqs[i] = limits.Request{Tenant: t.name, User: u, Rules: res.Subject, Counted: res.Counted}
	}
	out := make([]SubjectWindows, len(users))
	var failed error
	read := 0
	for i, r := range rd.windows.Limiter.PeekBatch(ctx, reqs) {
		switch {
		case errors.Is(r.Err, limits.ErrInvalid):
			out[i] = SubjectWindows{User: users[i], Plan: res.Plan, Windows: []Window{}, err: "not an identifier admission accepts: its windows cannot be read"}
			continue
		case r.Err != nil:
			failed = fmt.Errorf("%w: %s/%s: %w", ErrRedis, t.name, users[i], r.Err)
			out[i] = SubjectWindows{User: users[i], Plan: res.Plan, Windows: []Window{}, err: "its windows could not be read; try again"}
			continue
		}
		read++
		d := &r.Decision
		sw := SubjectWindows{User: users[i], Plan: res.Plan, Now: d.Now.UTC(), Windows: make([]Window, len(d.States))}
		for j := range d.States {
			s := &d.States[j]
			w := Window{Scope: s.Rule.Scope, Endpoint: s.Rule.Endpoint, Name: s.Rule.Name, Kind: s.Rule.Kind, Unit: s.Rule.Unit,
				Limit: s.Limit, Used: s.Used, Remaining: s.Remaining, Shadow: s.Rule.Shadow}
			if s.Reset > 0 {
				at := d.Now.Add(s.Reset).UTC()
				w.Reset = &at
			}
			sw.Windows[j] = w
		}
		out[i] = sw
	}
	if failed != nil && read == 0 {
		return nil, failed
	}
	return out, nil
}

// SubjectsPage is one page of a tenant's subjects on Plan: Tenant holds
// its tenant-wide limits (on the first page only: they are every user's),
// Users each user with its own limits. Next is the after of the next page,
// "" after the last.
type SubjectsPage struct {
	Plan   string        `json:"plan"`
	Tenant []Window      `json:"tenant"`
	Users  []UserWindows `json:"users"`
	Next   string        `json:"next,omitempty"`
}

// UserWindows is one user and its own limits (scope user), or Error, why
// they could not be read (an identifier admission would not accept).
type UserWindows struct {
	User    string   `json:"user"`
	Windows []Window `json:"windows"`
	Error   string   `json:"error,omitempty"`
}

// selectSubjects lists a tenant's users in the ledger after $2, in order,
// by walking the primary key of reservations from one user to the next (a
// recursive skip scan, as selectTenants): at most $3 index probes, however
// many requests each user made.
const selectSubjects = `
WITH RECURSIVE u(user_id) AS (
    (SELECT user_id FROM reservations WHERE tenant = $1 AND user_id > $2 ORDER BY user_id LIMIT 1)
    UNION ALL
    SELECT (SELECT r.user_id FROM reservations r WHERE r.tenant = $1 AND r.user_id > u.user_id ORDER BY r.user_id LIMIT 1)
    FROM u WHERE u.user_id IS NOT NULL
)
SELECT user_id FROM u WHERE user_id IS NOT NULL LIMIT $3`

// Users returns the windows of t's users in the ledger (every user with a
// request in it) on plan (empty: the tenant's own; see rules), at most
// limit of them after the user after, in order. Their windows are read in
// one pipelined round trip.
func (rd *Reader) Users(ctx context.Context, t Tenant, plan, after string, limit int) (SubjectsPage, error) {
	if err := checkCursor(after); err != nil {
		return SubjectsPage{}, err
	}
	res, err := rd.rules(t, plan)
	if err != nil {
		return SubjectsPage{}, err
	}
	// One more than a page: Next only when a user follows.
	users, err := collect(ctx, rd, selectSubjects, []any{t.name, after, limit + 1}, pgx.RowTo[string])
	if err != nil {
		return SubjectsPage{}, fmt.Errorf("users of %s: %w", t.name, err)
	}
	page := SubjectsPage{Plan: res.Plan, Tenant: []Window{}, Users: make([]UserWindows, 0, len(users))}
	if len(users) > limit {
		users = users[:limit]
		page.Next = users[limit-1]
	}
	if len(users) == 0 {
		return page, nil
	}
	sws, err := rd.peek(ctx, t, res, users)
	if err != nil {
		return SubjectsPage{}, err
	}
	for i, sw := range sws {
		u := UserWindows{User: sw.User, Windows: []Window{}, Error: sw.err}
		for _, w := range sw.Windows {
			switch {
			case w.Scope != policy.ScopeTenant:
				u.Windows = append(u.Windows, w)
			case i == 0 && after == "":
				page.Tenant = append(page.Tenant, w)
			}
		}
		page.Users = append(page.Users, u)
	}
	return page, nil
}

// Near returns the page of t's subjects Users reads on plan (so a balance
// spent long ago counts too), keeping only the limits at threshold percent
// or more and the users with one, or whose windows could not be read. A
// page may hold none and still have a Next: paging on covers every near
// subject once.
func (rd *Reader) Near(ctx context.Context, t Tenant, plan string, threshold int, after string, limit int) (SubjectsPage, error) {
	page, err := rd.Users(ctx, t, plan, after, limit)
	if err != nil {
		return SubjectsPage{}, err
	}
	far := func(w Window) bool { return !w.near(threshold) }
	page.Tenant = slices.DeleteFunc(page.Tenant, far)
	users := page.Users[:0]
	for _, u := range page.Users {
		if u.Windows = slices.DeleteFunc(u.Windows, far); len(u.Windows) > 0 || u.Error != "" {
			users = append(users, u)
		}
	}
	page.Users = users
	return page, nil
}
