package main

import (
	"context"
	"errors"
	"slices"
	"time"

	"quotaflow/internal/alertlog"
	"quotaflow/services/accounter/internal/console"
	"quotaflow/services/accounter/internal/history"
)

// consoleSource reads the console's pages from the ledger and the users'
// windows from Redis through the history package: every call checks its tenant again against the
// signed-in principal the console puts in ctx (history's one scoping
// check), so a page cannot read a tenant its token may not.
type consoleSource struct {
	rd     *history.Reader
	alerts history.AlertSource // rd, or the alerter's API
}

// errNoPrincipal is a call outside a signed-in page: the console's bug.
var errNoPrincipal = errors.New("console: no signed-in principal in the request")

// tenant returns tenant as the signed-in viewer may read it.
func (s consoleSource) tenant(ctx context.Context, tenant string) (history.Tenant, error) {
	p, ok := console.Principal(ctx)
	if !ok {
		return history.Tenant{}, errNoPrincipal
	}
	return history.ViewerOf(p).Tenant(tenant)
}

// ledgerErr is err, a failed read of the ledger, as the page says it: a
// read past QF_CONSOLE_QUERY_TIMEOUT is said (503), not "try again".
func ledgerErr(err error) error {
	if errors.Is(err, history.ErrTimeout) {
		return &console.SourceDown{Why: "Reading the ledger took too long; try a shorter range, or again later.", Err: err}
	}
	return err
}

// tenantsPerPage is how many tenants a page of the console lists.
const tenantsPerPage = history.MaxLimit

// Tenants reads one more tenant than a page holds, to know whether there
// is a next page.
func (s consoleSource) Tenants(ctx context.Context, after string) (console.Tenants, error) {
	p, ok := console.Principal(ctx)
	if !ok {
		return console.Tenants{}, errNoPrincipal
	}
	ts, err := s.rd.Tenants(ctx, history.ViewerOf(p), after, tenantsPerPage+1)
	if err != nil || len(ts) <= tenantsPerPage {
		return console.Tenants{Tenants: ts}, ledgerErr(err)
	}
	ts = ts[:tenantsPerPage]
	return console.Tenants{Tenants: ts, Next: ts[len(ts)-1]}, nil
}

// usersPerPage is how many users a page of the console reads: their
// windows are one pipelined Redis round trip.
const usersPerPage = history.DefaultLimit

func (s consoleSource) Users(ctx context.Context, tenant, plan, after string) (console.Subjects, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return console.Subjects{}, err
	}
	page, err := s.rd.Users(ctx, t, plan, after, usersPerPage)
	return s.subjectsOf(t, page, err)
}

func (s consoleSource) Near(ctx context.Context, tenant, plan string, threshold int, after string) (console.Subjects, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return console.Subjects{}, err
	}
	page, err := s.rd.Near(ctx, t, plan, threshold, after, usersPerPage)
	return s.subjectsOf(t, page, err)
}

// subjectsOf is the page of t's subjects p, or the page's answer to err:
// a plan the viewer may not read, or none of the policy, is
// console.ErrUnknownPlan, and Redis too busy is said.
func (s consoleSource) subjectsOf(t history.Tenant, p history.SubjectsPage, err error) (console.Subjects, error) {
	var pe *history.ParamError
	switch {
	case errors.Is(err, history.ErrForbidden), errors.As(err, &pe) && pe.Param == "plan":
		return console.Subjects{}, console.ErrUnknownPlan
	case errors.Is(err, history.ErrBusy):
		return console.Subjects{}, &console.SourceDown{Why: "Redis is being read for too many pages at once; try again in a second.", Err: err}
	case err != nil:
		return console.Subjects{}, ledgerErr(err)
	}
	out := console.Subjects{Plan: p.Plan, Plans: s.rd.Plans(t), Tenant: windowsOf(p.Tenant), Next: p.Next}
	if !slices.Contains(out.Plans, p.Plan) { // an admin may read any plan
		out.Plans = append(out.Plans, p.Plan)
	}
	for _, u := range p.Users {
		out.Users = append(out.Users, console.User{User: u.User, Windows: windowsOf(u.Windows), Error: u.Error})
	}
	return out, nil
}

func windowsOf(ws []history.Window) []console.Window {
	out := make([]console.Window, len(ws))
	for i, w := range ws {
		name := string(w.Scope) + " " + w.Name
		if w.Endpoint != "" {
			name = "endpoint " + w.Endpoint + " " + w.Name // a user's limit on requests to that endpoint
		}
		out[i] = console.Window{Name: name, Limit: w.Limit, Used: w.Used, Remaining: w.Remaining}
		if w.Reset != nil {
			out[i].Reset = *w.Reset
		}
	}
	return out
}

func (s consoleSource) History(ctx context.Context, tenant, user string, from, to time.Time, step console.Step) ([]console.Point, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return nil, err
	}
	pts, err := s.rd.History(ctx, t, user, history.Range{From: from, To: to, Step: history.Step(step)})
	if err != nil {
		return nil, ledgerErr(err)
	}
	out := make([]console.Point, len(pts))
	for i, pt := range pts {
		out[i] = console.Point{Start: pt.Start, Tokens: pt.Tokens, Requests: pt.Requests}
	}
	return out, nil
}

func (s consoleSource) TopUsers(ctx context.Context, tenant string, from, to time.Time, limit int) ([]console.UserTotal, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return nil, err
	}
	top, err := s.rd.TopUsers(ctx, t, from, to, history.Page{Limit: limit})
	if err != nil {
		return nil, ledgerErr(err)
	}
	out := make([]console.UserTotal, len(top))
	for i, u := range top {
		out[i] = console.UserTotal{User: u.User, Tokens: u.Tokens, Requests: u.Requests}
	}
	return out, nil
}

func (s consoleSource) Denials(ctx context.Context, tenant string, from, to time.Time) ([]console.Denial, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return nil, err
	}
	ds, err := s.rd.Denials(ctx, t, from, to, history.Page{Limit: history.MaxLimit})
	if err != nil {
		return nil, ledgerErr(err)
	}
	out := make([]console.Denial, len(ds))
	for i, d := range ds {
		out[i] = console.Denial{Limit: d.Scope + " " + d.Limit, Count: d.Denied}
	}
	return out, nil
}

// Alerts reads from s.alerts with the viewer's own token; an alerter that
// does not answer, or refuses, is said on the page.
func (s consoleSource) Alerts(ctx context.Context, tenant string, limit int) ([]console.Alert, error) {
	t, err := s.tenant(ctx, tenant)
	if err != nil {
		return nil, err
	}
	as, err := s.alerts.Alerts(ctx, console.Authorization(ctx), t, history.Page{Limit: limit})
	switch {
	case errors.Is(err, alertlog.ErrNoOutbox):
		return nil, console.ErrNotAvailable
	case errors.Is(err, alertlog.ErrUnreachable):
		return nil, &console.SourceDown{Why: "The alerter (QF_ALERTER_URL) cannot be reached; try again.", Err: err}
	case errors.Is(err, alertlog.ErrBadAnswer):
		return nil, &console.SourceDown{Why: "Alerts are not available: " + err.Error() + ".", Err: err}
	case err != nil:
		return nil, ledgerErr(err)
	}
	out := make([]console.Alert, len(as))
	for i, a := range as {
		out[i] = console.Alert{At: a.At, User: a.User, Kind: a.Kind, Limit: a.Limit, Threshold: a.Threshold}
	}
	return out, nil
}
