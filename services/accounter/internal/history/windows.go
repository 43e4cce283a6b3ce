package history

import (
	"context"
	"errors"
	"fmt"
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

// ErrRedis wraps a failed read of Redis (down, or lost its data and not yet
// rebuilt). Handlers answer it with 503.
var ErrRedis = errors.New("the windows in Redis could not be read")

// WindowsSource is where a Reader reads windows: the Limiter and the
// current policy, which resolves a subject's plan as admission's GET
// /v1/usage does (the tenant's plan, else default_plan; no endpoint).
type WindowsSource struct {
	Limiter Peeker
	Policy  func() *policy.Policy
}

// Window is one limit of a subject as Redis holds it now: Used of Limit
// (for a balance, the credits topped up so far), Remaining, and Reset, when
// it next frees capacity or resets: nil where the engine gives none (a
// balance, a concurrency limit, a rolling, sliding-log or token-bucket
// limit holding nothing).
type Window struct {
	Scope     policy.Scope `json:"scope"`
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
}

// Windows returns every tenant-wide and user limit of t's user under its
// plan in the current policy, as Redis holds them now.
func (rd *Reader) Windows(ctx context.Context, t Tenant, user string) (SubjectWindows, error) {
	if err := checkID("user", user, true); err != nil {
		return SubjectWindows{}, err
	}
	rs, err := rd.peek(ctx, t, []string{user})
	if err != nil {
		return SubjectWindows{}, err
	}
	return rs[0], nil
}

// peek reads the windows of t's users, in one pipelined round trip.
func (rd *Reader) peek(ctx context.Context, t Tenant, users []string) ([]SubjectWindows, error) {
	res, err := rd.windows.Policy().Resolve(t.name, "", "")
	if err != nil {
		return nil, fmt.Errorf("windows of %s: %w", t.name, err)
	}
	reqs := make([]limits.Request, len(users))
	for i, u := range users {
		reqs[i] = limits.Request{Tenant: t.name, User: u, Rules: res.Subject, Counted: res.Counted}
	}
	out := make([]SubjectWindows, len(users))
	for i, r := range rd.windows.Limiter.PeekBatch(ctx, reqs) {
		if r.Err != nil {
			return nil, fmt.Errorf("%w: %s/%s: %w", ErrRedis, t.name, users[i], r.Err)
		}
		d := &r.Decision
		sw := SubjectWindows{User: users[i], Plan: res.Plan, Now: d.Now.UTC(), Windows: make([]Window, len(d.States))}
		for j := range d.States {
			s := &d.States[j]
			w := Window{Scope: s.Rule.Scope, Name: s.Rule.Name, Kind: s.Rule.Kind, Unit: s.Rule.Unit,
				Limit: s.Limit, Used: s.Used, Remaining: s.Remaining, Shadow: s.Rule.Shadow}
			if s.Reset > 0 {
				at := d.Now.Add(s.Reset).UTC()
				w.Reset = &at
			}
			sw.Windows[j] = w
		}
		out[i] = sw
	}
	return out, nil
}

// SubjectsPage is one page of a tenant's subjects: Tenant holds its
// tenant-wide limits (on the first page only: they are every user's), Users
// each user with its own limits. Next is the after of the next page, ""
// after the last.
type SubjectsPage struct {
	Tenant []Window      `json:"tenant"`
	Users  []UserWindows `json:"users"`
	Next   string        `json:"next,omitempty"`
}

// UserWindows is one user and its own limits (scope user).
type UserWindows struct {
	User    string   `json:"user"`
	Windows []Window `json:"windows"`
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
// request in it), at most limit of them after the user after, in order.
// Their windows are read in one pipelined round trip.
func (rd *Reader) Users(ctx context.Context, t Tenant, after string, limit int) (SubjectsPage, error) {
	if err := checkID("after", after, false); err != nil {
		return SubjectsPage{}, err
	}
	rows, err := rd.pool.Query(ctx, selectSubjects, t.name, after, limit)
	if err != nil {
		return SubjectsPage{}, fmt.Errorf("users of %s: %w", t.name, err)
	}
	users, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return SubjectsPage{}, fmt.Errorf("users of %s: %w", t.name, err)
	}
	page := SubjectsPage{Tenant: []Window{}, Users: make([]UserWindows, len(users))}
	if len(users) == limit {
		page.Next = users[len(users)-1]
	}
	if len(users) == 0 {
		return page, nil
	}
	sws, err := rd.peek(ctx, t, users)
	if err != nil {
		return SubjectsPage{}, err
	}
	for i, sw := range sws {
		page.Users[i] = UserWindows{User: sw.User, Windows: []Window{}}
		for _, w := range sw.Windows {
			switch {
			case w.Scope != policy.ScopeTenant:
				page.Users[i].Windows = append(page.Users[i].Windows, w)
			case i == 0 && after == "":
				page.Tenant = append(page.Tenant, w)
			}
		}
	}
	return page, nil
}

// Near returns the page of t's subjects Users reads (so a balance spent
// long ago counts too), keeping only the limits at threshold percent or
// more and the users with one. A page may hold none and still have a
// Next: paging on covers every near subject once.
func (rd *Reader) Near(ctx context.Context, t Tenant, threshold int, after string, limit int) (SubjectsPage, error) {
	page, err := rd.Users(ctx, t, after, limit)
	if err != nil {
		return SubjectsPage{}, err
	}
	far := func(w Window) bool { return !w.near(threshold) }
	page.Tenant = slices.DeleteFunc(page.Tenant, far)
	users := page.Users[:0]
	for _, u := range page.Users {
		if u.Windows = slices.DeleteFunc(u.Windows, far); len(u.Windows) > 0 {
			users = append(users, u)
		}
	}
	page.Users = users
	return page, nil
}
