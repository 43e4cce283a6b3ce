package httpapi

import (
	"context"
	"net/http"

	"quotaflow/internal/auth"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
)

// releaseBody is the body of POST /v1/release.
type releaseBody struct {
	Tenant    string `json:"tenant"`
	User      string `json:"user"`
	RequestID string `json:"request_id"`
}

// releaseAnswer is its answer.
type releaseAnswer struct {
	RequestID string `json:"request_id"`
	// Status is "released" (given back now), "already_settled" (released
	// or corrected before), "unknown" (no such reservation, e.g. it
	// expired) or, with a 202 while Redis is out of reach, "queued" (the
	// accounter gives the estimate back).
	Status string `json:"status"`
	// ReturnedTokens is the estimate given back now (0 unless released).
	ReturnedTokens int64 `json:"returned_tokens"`
}

// readJSON authenticates the caller in role and decodes the request's JSON
// body into v strictly; when it returns false it has answered already.
func (h *Handler) readJSON(w http.ResponseWriter, r *http.Request, role auth.Roles, v any) (auth.Principal, bool) {
	p, ok := h.authenticate(w, r, role)
	if !ok {
		return p, false
	}
	raw, ok := readBody(w, r)
	if !ok {
		return p, false
	}
	if ferr := decodeStrict(raw, v); ferr != nil {
		writeFieldError(w, ferr)
		return p, false
	}
	return p, true
}

// idField is an identifier to check, with its field name.
type idField struct {
	name, v  string
	required bool
}

// checkIDs checks identifiers (length, UTF-8, presence); when it returns
// false it has answered with the first bad one.
func checkIDs(w http.ResponseWriter, fields ...idField) bool {
	if ferr := firstBadID(fields...); ferr != nil {
		writeFieldError(w, ferr)
		return false
	}
	return true
}

// firstBadID checks identifiers as checkIDs does and returns the first bad
// one's problem.
func firstBadID(fields ...idField) *fieldError {
	for _, f := range fields {
		if ferr := checkID(f.name, f.v, f.required); ferr != nil {
			return ferr
		}
	}
	return nil
}

func (h *Handler) serveRelease(w http.ResponseWriter, r *http.Request) {
	var b releaseBody
	p, ok := h.readJSON(w, r, auth.Gateway, &b)
	if !ok || !checkIDs(w, idField{"tenant", b.Tenant, true}, idField{"user", b.User, true}, idField{"request_id", b.RequestID, true}) {
		return
	}
	if !authorize(w, p, b.Tenant) {
		return
	}
	a, err := h.release(r.Context(), b.Tenant, b.User, b.RequestID)
	switch {
	case err != nil:
		h.infraError(w, r, "release", "", err)
	case a.Status == events.ReleaseQueued:
		writeJSON(w, http.StatusAccepted, "application/json", a)
	default:
		writeJSON(w, http.StatusOK, "application/json", a)
	}
}

// release gives back the reservation of requestID and publishes the
// released event saying what it did. While Redis is out of reach it
// publishes a queued release instead, for the accounter to give the
// estimate back, and returns status queued with no error: no caller is
// failed because Redis is down. Errors are the caller's mistakes or its
// leaving (ctx).
func (h *Handler) release(ctx context.Context, tenant, user, requestID string) (releaseAnswer, error) {
	s, err := h.dec.Release(ctx, tenant, user, requestID)
	if err != nil {
		if _, bad := clientError(err, ""); bad || canceled(ctx, err) {
			return releaseAnswer{}, err
		}
		// The released event alone is enough, since the accounter gives
		// back the estimate of every reservation the ledger holds open
		// when it consumes it.
		h.log.Warn("release queued for the accounter", "err", err)
		h.ev.Enqueue(events.NewReleased(h.source, events.Released{RequestID: requestID, Tenant: tenant, User: user,
			Status: events.ReleaseQueued}, nowUTC()))
		return releaseAnswer{RequestID: requestID, Status: events.ReleaseQueued}, nil
	}
	a := releaseAnswer{RequestID: requestID}
	switch s.Status {
	case limits.Settled:
		a.Status, a.ReturnedTokens = events.ReleaseReleased, max(-s.Delta, 0)
	case limits.AlreadySettled:
		a.Status = events.ReleaseAlreadySettled
	default:
		a.Status = events.ReleaseUnknown
	}
	// Published whatever the status, saying what the release did: the
	// ledger learns of it, and a reservation Redis no longer knows may
	// still be open there (after Redis lost its data).
	at := s.Now
	if at.IsZero() {
		at = nowUTC()
	}
	h.ev.Enqueue(events.NewReleased(h.source, events.Released{RequestID: requestID, Tenant: tenant, User: user,
		Status: a.Status, ReturnedTokens: a.ReturnedTokens}, at))
	return a, nil
}

// infraError answers a failure of the decider outside the admission path
// (release, usage, top-up): 400 for the caller's mistakes (plan is the one
// the caller named, if any), else 503 with Retry-After, since each of these
// calls is safe to retry.
func (h *Handler) infraError(w http.ResponseWriter, r *http.Request, what, plan string, err error) {
	if msg, ok := clientError(err, plan); ok {
		writeError(w, http.StatusBadRequest, msg)
		return
	}
	if canceled(r.Context(), err) {
		writeError(w, 499, "client closed the request")
		return
	}
	h.log.Warn(what+" failed", "err", err)
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusServiceUnavailable, what+": temporarily unavailable, retry")
}

// topUpBody is the body of POST /v1/balances/topup.
type topUpBody struct {
	Tenant    string `json:"tenant"`
	User      string `json:"user"`
	Amount    *int64 `json:"amount"`
	Reference string `json:"reference"`
}

// topUpAnswer is its answer.
type topUpAnswer struct {
	Tenant    string `json:"tenant"`
	User      string `json:"user,omitempty"`
	Reference string `json:"reference"`
	// Applied is false when this reference was applied before (nothing
	// changed).
	Applied  bool  `json:"applied"`
	Credited int64 `json:"credited"`
	Spent    int64 `json:"spent"`
	Balance  int64 `json:"balance"`
}

func (h *Handler) serveTopUp(w http.ResponseWriter, r *http.Request) {
	var b topUpBody
	p, ok := h.readJSON(w, r, auth.Billing, &b)
	if !ok || !checkIDs(w, idField{"tenant", b.Tenant, true}, idField{"user", b.User, false}, idField{"reference", b.Reference, true}) {
		return
	}
	if b.Amount == nil {
		writeFieldError(w, bad("amount", "required"))
		return
	}
	if *b.Amount < 1 || *b.Amount > limits.MaxCost {
		writeFieldError(w, bad("amount", "must be a whole number from 1 to %d", int64(limits.MaxCost)))
		return
	}
	if !authorize(w, p, b.Tenant) {
		return
	}
	res, err := h.dec.TopUp(r.Context(), b.Tenant, b.User, *b.Amount, b.Reference)
	if err != nil {
		h.infraError(w, r, "topup", "", err)
		return
	}
	h.ev.Enqueue(events.NewTopUp(h.source, events.TopUp{Tenant: b.Tenant, User: b.User, Amount: *b.Amount, Reference: b.Reference}, nowUTC()))
	writeJSON(w, http.StatusOK, "application/json", topUpAnswer{
		Tenant: b.Tenant, User: b.User, Reference: b.Reference, Applied: res.Applied,
		Credited: res.Credited, Spent: res.Spent, Balance: res.Credited - res.Spent,
	})
}
