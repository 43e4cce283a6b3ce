package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

func nowUTC() time.Time { return time.Now().UTC() }

// usageAnswer is the body of GET /v1/usage.
type usageAnswer struct {
	Tenant string      `json:"tenant"`
	User   string      `json:"user"`
	Plan   string      `json:"plan,omitempty"`
	Limits []limitJSON `json:"limits"`
}

// serveUsageGet answers GET /v1/usage?tenant=..&user=..[&plan=..] with
// every limit of the subject, changing nothing.
func (h *Handler) serveUsageGet(w http.ResponseWriter, r *http.Request) {
	p, ok := h.authenticate(w, r, auth.Gateway)
	if !ok {
		return
	}
	q := r.URL.Query()
	tenant, user, plan := q.Get("tenant"), q.Get("user"), q.Get("plan")
	if !checkIDs(w, idField{"tenant", tenant, true}, idField{"user", user, true}, idField{"plan", plan, false}) {
		return
	}
	if !authorizePlan(w, p, h.policy(), tenant, plan) {
		return
	}
	ls, err := h.dec.Usage(r.Context(), tenant, user, plan)
	if err != nil {
		h.infraError(w, r, "usage", plan, err)
		return
	}
	writeJSON(w, http.StatusOK, "application/json", usageAnswer{Tenant: tenant, User: user, Plan: plan, Limits: limitsJSON(ls)})
}

// writeAccepted answers a stored report: 202 and {"accepted":n}, written
// as writeJSON would write it but without reflection, since every report
// is answered so, and with a decision's Date (dateOf).
func writeAccepted(w http.ResponseWriter, n int) {
	h := w.Header()
	h[hdrContentType] = jsonType
	h[hdrCacheControl] = noStore
	h[hdrDate] = dateOf(time.Now())
	w.WriteHeader(http.StatusAccepted)
	bp := bufPool.Get().(*[]byte)
	b := strconv.AppendInt(append((*bp)[:0], `{"accepted":`...), int64(n), 10)
	_, _ = w.Write(append(b, "}\n"...))
	*bp = b
	bufPool.Put(bp)
}

// serveUsageReport publishes a JSON array of usage CloudEvents (actual or
// released) and answers 202 once JetStream stored every one. Each event is
// validated as consumers will (events.DecodeReported, and its time against
// now as the first storage); the first bad one is named by its index. Event
// ids are derived here from each event's type, tenant, user and request id
// (a caller's id is ignored), so a retried report is stored once and no
// caller can claim an id of another's event.
func (h *Handler) serveUsageReport(w http.ResponseWriter, r *http.Request) {
	p, ok := h.authenticate(w, r, auth.Report)
	if !ok {
		return
	}
	raw, ok := readBody(w, r)
	if !ok {
		return
	}
	evs, ferr := decodeUsage(raw, time.Now(), h.maxAge)
	if ferr != nil {
		writeFieldError(w, ferr)
		return
	}
	for _, ev := range evs {
		if !authorize(w, p, eventTenant(ev)) {
			return
		}
	}
	if err := h.publishReported(r.Context(), evs); err != nil {
		if canceled(r.Context(), err) {
			writeError(w, 499, "client closed the request")
			return
		}
		var be *stream.BatchError
		n := len(evs)
		if errors.As(err, &be) {
			n = len(be.Unwrap())
		}
		h.log.Warn("publishing reported usage failed", "events", len(evs), "failed", n, "err", err)
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable,
			fmt.Sprintf("events: %d of %d not stored by the stream; retry the whole report (event ids dedup)", n, len(evs)))
		return
	}
	writeAccepted(w, len(evs))
}

// publishReported publishes reported events (checked by reportedEvents)
// and returns once the stream stored every one, waiting at most the
// usage timeout.
func (h *Handler) publishReported(ctx context.Context, evs []events.Event) error {
	return h.ev.PublishNow(ctx, evs, h.usageTO)
}

// decodeUsage parses the body of POST /v1/usage: a non-empty JSON array of
// actual or released events, each with a time within the stream's maxAge
// before now and events.MaxSkew after it; it derives their ids.
func decodeUsage(body []byte, now time.Time, maxAge time.Duration) ([]events.Event, *fieldError) {
	evs, errs, err := events.DecodeReportedBatch(body)
	if err != nil || checkSurrogates(body) != nil {
		var ferr *fieldError
		if evs, errs, ferr = decodeUsageSlow(body); ferr != nil {
			return nil, ferr
		}
	}
	return reportedEvents(evs, errs, now, maxAge)
}

// reportedEvents checks decoded reported events (evs[i] holds when errs[i]
// is nil) in order: the first bad one is the error; it derives their ids.
func reportedEvents(evs []events.Event, errs []error, now time.Time, maxAge time.Duration) ([]events.Event, *fieldError) {
	for i := range evs {
		if errs[i] != nil {
			return nil, eventError(i, errs[i])
		}
		ev := &evs[i]
		switch d := ev.Data.(type) {
		case events.Actual:
			ev.ID = events.ID(events.TypeActual, d.Tenant, d.User, d.RequestID)
		case events.Released:
			ev.ID = events.ID(events.TypeReleased, d.Tenant, d.User, d.RequestID)
		default:
			return nil, bad(fmt.Sprintf("[%d].type", i), "%q cannot be reported here; want %s or %s",
				ev.Type(), events.TypeActual, events.TypeReleased)
		}
		if err := events.CheckTime(ev.Time, now, maxAge); err != nil {
			return nil, eventError(i, err)
		}
	}
	return evs, nil
}

// decodeUsageSlow decodes a body that events.DecodeReportedBatch refused
// as a whole: decodeStrict names what is wrong with it, and when it finds
// nothing (an array beyond events.MaxBatchEvents), each element is decoded
// alone.
func decodeUsageSlow(body []byte) ([]events.Event, []error, *fieldError) {
	var raws []json.RawMessage
	if ferr := decodeStrict(body, &raws); ferr != nil {
		if ferr.field == "body" && ferr.problem == "must be a JSON object" {
			ferr.problem = "must be a JSON array of CloudEvents"
		}
		return nil, nil, ferr
	}
	if len(raws) == 0 {
		return nil, nil, bad("body", "no events; want a JSON array of CloudEvents")
	}
	evs, errs := make([]events.Event, len(raws)), make([]error, len(raws))
	for i, raw := range raws {
		evs[i], errs[i] = events.DecodeReported(raw)
	}
	return evs, errs, nil
}

// eventError turns events.Decode's "invalid event: a: x; b: y" into
// "[i].a: x; [i].b: y".
func eventError(i int, err error) *fieldError {
	msg := strings.TrimPrefix(err.Error(), events.ErrInvalid.Error()+": ")
	parts := strings.Split(msg, "; ")
	idx := fmt.Sprintf("[%d]", i)
	for j, part := range parts {
		if !strings.HasPrefix(part, "and ") {
			parts[j] = idx + "." + part
		}
	}
	field, problem, found := strings.Cut(strings.Join(parts, "; "), ": ")
	if !found {
		return bad(idx, "%s", msg)
	}
	return &fieldError{field: field, problem: problem}
}

// eventTenant is the tenant an event is about.
func eventTenant(ev events.Event) string {
	switch d := ev.Data.(type) {
	case events.Actual:
		return d.Tenant
	case events.Released:
		return d.Tenant
	}
	return ""
}
