package httpapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
)

// limitJSON is one limit in a response, as docs/design.md §4 shows it.
type limitJSON struct {
	Scope        string `json:"scope"`
	Name         string `json:"name"`
	Endpoint     string `json:"endpoint,omitempty"` // endpoint limits only
	Unit         string `json:"unit"`
	Limit        int64  `json:"limit"`
	Used         int64  `json:"used"`
	Remaining    int64  `json:"remaining"`
	ResetSeconds int64  `json:"reset_seconds"`
	Shadow       bool   `json:"shadow,omitempty"` // counted, never denies
}

// limitRef names the limit that denied.
type limitRef struct {
	Scope    string `json:"scope"`
	Name     string `json:"name"`
	Endpoint string `json:"endpoint,omitempty"`
}

// decisionBody is the body of an admit or authz answer; on a denial it
// is also an RFC 9457 problem (the first five fields).
type decisionBody struct {
	Type              string      `json:"type,omitempty"`
	Title             string      `json:"title,omitempty"`
	Status            int         `json:"status,omitempty"`
	Detail            string      `json:"detail,omitempty"`
	ViolatedPolicies  []string    `json:"violated-policies,omitempty"`
	Allowed           bool        `json:"allowed"`
	RequestID         string      `json:"request_id"`
	DeniedBy          *limitRef   `json:"denied_by,omitempty"`
	Reason            string      `json:"reason,omitempty"`
	RetryAfterSeconds int64       `json:"retry_after_seconds,omitempty"`
	Limits            []limitJSON `json:"limits"`
}

func limitsJSON(ls []decide.LimitState) []limitJSON {
	return appendLimitsJSON(make([]limitJSON, 0, len(ls)), ls)
}

// appendLimitsJSON appends the limits ls to dst.
func appendLimitsJSON(dst []limitJSON, ls []decide.LimitState) []limitJSON {
	for _, l := range ls {
		dst = append(dst, limitJSON{
			Scope: string(l.Scope), Name: l.Name, Endpoint: l.Endpoint, Unit: string(l.Unit),
			Limit: l.Limit, Used: l.Used, Remaining: l.Remaining, ResetSeconds: ceilSeconds(l.Reset),
			Shadow: l.Shadow,
		})
	}
	return dst
}

// answerLimits is how many limits an answer holds without a heap
// allocation (its body is encoded before the handler returns).
const answerLimits = 8

// limitRooms hold the limits of decisions (decide.Input.Room): the
// handler reads them into the answer and the event (which copies them)
// and lets go before it returns, and a new array per admit was the
// largest of admission's allocations (bench/results.md, "Admission's CPU
// per call (session 9)").
var limitRooms = sync.Pool{New: func() any { return new([decide.RoomLimits]decide.LimitState) }}

func (h *Handler) serveAdmit(w http.ResponseWriter, r *http.Request) {
	p, ok := h.authenticate(w, r, auth.Gateway)
	if !ok {
		return
	}
	body, ok := readBody(w, r)
	if !ok {
		return
	}
	pol := h.policy()
	in, ferr := decodeAdmit(body, pol.Cost)
	if ferr != nil {
		writeFieldError(w, ferr)
		return
	}
	if !authorizePlan(w, p, pol, in.Tenant, in.Plan) {
		return
	}
	h.decide(r.Context(), w, routeAdmit, in, http.StatusTooManyRequests, false)
}

// decide runs one admission and writes the answer: 200 when allowed,
// denyStatus with a problem body when denied. For an authz check it
// returns what is wrong with a request that cannot be checked (a denial
// too), "" otherwise.
func (h *Handler) decide(ctx context.Context, w http.ResponseWriter, route string,
	in decide.Input, denyStatus int, authz bool) (invalid string) {
	in.CallerID = in.RequestID != ""
	if !in.CallerID {
		in.RequestID = newRequestID()
	}
	in.Room = limitRooms.Get().(*[decide.RoomLimits]decide.LimitState)
	defer func(room *[decide.RoomLimits]decide.LimitState) {
		*room = [decide.RoomLimits]decide.LimitState{} // no strings kept alive
		limitRooms.Put(room)
	}(in.Room)
	res, err := h.dec.Admit(ctx, in)
	if err != nil {
		if errors.Is(err, decide.ErrConflict) {
			writeError(w, http.StatusConflict, err.Error())
			return ""
		}
		if msg, ok := clientError(err, in.Plan); ok {
			if authz {
				denyInvalid(w, denyStatus, msg)
				return msg
			}
			writeError(w, http.StatusBadRequest, msg)
			return ""
		}
		if canceled(ctx, err) {
			writeError(w, 499, "client closed the request")
			return ""
		}
		// Never fail the gateway's traffic on our own failure.
		h.failopen.WithLabelValues(route).Inc()
		h.log.Error("decider failed; allowing the request", "route", route, "request_id", in.RequestID, "err", err)
		writeDecision(w, http.StatusOK, jsonType, &decisionBody{Allowed: true, RequestID: in.RequestID, Limits: []limitJSON{}})
		return ""
	}
	if res.Now.IsZero() {
		res.Now = time.Now()
	}
	h.publishDecision(in, res)

	retry := retryAfterSeconds(res)
	setRateLimitHeaders(w.Header(), &res, in.Cost, retry)
	var ls [answerLimits]limitJSON
	body := decisionBody{Allowed: res.Allowed, RequestID: in.RequestID, Limits: appendLimitsJSON(ls[:0], res.Limits)}
	if res.Allowed {
		writeDecision(w, http.StatusOK, jsonType, &body)
		return ""
	}
	body.Reason = string(res.Reason)
	body.RetryAfterSeconds = retry
	body.Type = ProblemQuotaExceeded
	body.Title = "Request cannot be satisfied as assigned quota has been exceeded"
	body.Status = denyStatus
	if d := res.DeniedBy; d != nil {
		body.DeniedBy = &limitRef{Scope: string(d.Scope), Name: d.Name, Endpoint: d.Endpoint}
		body.ViolatedPolicies = []string{policyName(*d)}
		body.Detail = denialDetail(*d, res, in.Cost)
	} else if res.Reason == limits.ReasonRequestIDReused {
		body.Detail = "X-Request-Id: a reservation holds this id already; the gateway must send a new id with every request"
	}
	if authz {
		w.Header().Set("X-Quota-Denied", "1")
	}
	writeDecision(w, denyStatus, problemType, &body)
	return ""
}

// denialDetail explains a denial in one sentence.
func denialDetail(d decide.LimitState, res decide.Result, cost int64) string {
	what := fmt.Sprintf("%s limit %q", d.Scope, d.Name)
	if d.Endpoint != "" {
		what = fmt.Sprintf("%s limit %q of endpoint %q", d.Scope, d.Name, d.Endpoint)
	}
	amount := int64(1)
	if d.Unit == policy.Tokens {
		amount = cost
	}
	switch res.Reason {
	case limits.ReasonCostExceedsLimit:
		return fmt.Sprintf("%s: the request needs %d %s, more than the limit of %d; it can never fit", what, amount, d.Unit, d.Limit)
	case limits.ReasonInsufficientBalance:
		return fmt.Sprintf("%s: the request needs %d %s but %d remain; only a top-up helps", what, amount, d.Unit, max(d.Remaining, 0))
	}
	return fmt.Sprintf("%s: the request needs %d %s but %d of %d remain", what, amount, d.Unit, max(d.Remaining, 0), d.Limit)
}

// publishDecision hands the decision's event to the outbox: a reserved
// event when allowed (again for a duplicate: its id dedups, and it covers a
// crash between reserving and publishing), one denial count when denied.
func (h *Handler) publishDecision(in decide.Input, res decide.Result) {
	if !res.Allowed {
		if res.DeniedBy != nil {
			h.ev.Denied(events.Denied{Tenant: in.Tenant, User: in.User, IP: in.IP, Endpoint: in.Endpoint,
				Scope: string(res.DeniedBy.Scope), Name: res.DeniedBy.Name}, res.Now)
		}
		return
	}
	ev := events.Reserved{
		RequestID: in.RequestID, Tenant: in.Tenant, User: in.User, Plan: res.Plan,
		Endpoint: in.Endpoint, Model: in.Model, IP: in.IP, EstimatedTokens: in.Cost,
		ExpiresAt: res.ExpiresAt, Version: res.Version, TenantVersion: res.TenantVersion,
	}
	if len(res.Limits) > 0 {
		ev.Limits = make([]events.LimitState, len(res.Limits))
		for i, l := range res.Limits {
			ev.Limits[i] = events.LimitState{
				Scope: string(l.Scope), Name: l.Name, Endpoint: l.Endpoint, Unit: string(l.Unit),
				Limit: l.Limit, Used: l.Used, Remaining: l.Remaining, ResetSeconds: ceilSeconds(l.Reset),
			}
			if l.WouldDeny {
				ev.WouldDeny = append(ev.WouldDeny, events.LimitRef{Scope: string(l.Scope), Name: l.Name, Endpoint: l.Endpoint})
			}
		}
	}
	h.ev.Enqueue(events.NewReserved(h.source, ev, res.Now))
}
