package rls

// Response-time costs (docs/design.md §4, gRPC). Envoy can report a
// request's cost twice: at request time (an estimate, or hits_addend 0) and
// when the response ends (the rate limit action's apply_on_stream_done, with
// hits_addend from dynamic metadata such as the used tokens). With
// Options.RequestIDKey and ActualIDKey, the entries of those keys name the
// request, and say which call it is: the request-time actions set the
// first, only the apply_on_stream_done action sets the second, so a client,
// who may choose the id (x-request-id) but not the actions, cannot make a
// call pass for a response-time one. The two calls are correlated through
// a record in Redis, keyed by (domain, tenant, user, request id):
//
//   - a request-time call is decided as any call, whatever records exist;
//     when Redis allows it, what it charged each counter is the request's
//     estimate, kept in a record (SET NX: a reused id's call keeps none,
//     and the first's stays) until the longest of those windows ends plus
//     one window (at most Options.RecordTTL);
//   - a response-time call claims the record (SET XX KEEPTTL GET: one
//     claimant, and the record becomes a mark) and moves each counter the
//     estimate charged that it names by its own hits (the actual) minus
//     the estimate, with decide's Adjust, never refused by a limit; a
//     counter whose estimate window has passed (or is within windowGuard
//     of its end), or whose rule changed window since (a reload), is
//     charged the actual in full instead, in its current window. A
//     give-back is dated at the first call's Redis time, so Redis makes it
//     only in the window the estimate was charged in: one that reaches
//     Redis after that window ended leaves the estimate counted. Counters
//     it names that the estimate did not charge, and counters the estimate
//     charged that it does not name, do not move. It answers OK with the
//     counters' state (a check of no hits; a counter past its limit has 0
//     remaining): Envoy ignores the answer of an apply_on_stream_done call;
//   - a response-time call that finds no record, or the mark (a duplicate,
//     or the second of two requests that reused an id), charges its hits
//     in full, never refused, and answers the counters' state as it is:
//     usage is never free, and a reused id can only overcharge its subject.
//
// Why not the reserved and actual events of the HTTP path: the accounter
// corrects a subject's reservation record in the subject's blob under
// QF_POLICY_FILE's rules, and an RLS request charges counters of other keys
// (one per descriptor, possibly several subjects) under the envoy
// configuration, which the accounter does not load; an actual event with no
// reservation would be charged in full to the tenant's policy quotas. So
// admission corrects the counters itself, and the ledger holds nothing of
// RLS calls, as before.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/ident"
	"quotaflow/services/admission/internal/decide"
)

// Corrector moves counters a Check charged, and says whether Redis is in
// use: *decide.Decider.
type Corrector interface {
	Adjust(ctx context.Context, c decide.Charge, amount int64, at time.Time) ([]decide.LimitState, error)
	Degraded() (bool, string)
}

// Records holds the estimates of requests with an id: a go-redis client
// (redis.UniversalClient).
type Records interface {
	SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd
}

// windowGuard is how close to its window's end an estimate is no longer
// corrected but left in its window, with the actual charged in full: the
// window's end is judged by this instance's clock from the first call's
// Redis reset (possibly another instance's). Since give-backs are dated
// (settle), a late one gives no credit either way; the guard is a margin
// that errs towards counting: within it a correction counts the estimate
// beside the actual.
const windowGuard = time.Second

// The result label values of quotaflow_admission_rls_request_ids_total:
// what a call with a request id did.
const (
	idEstimated    = "estimated"     // a first call's estimate was kept
	idNotEstimated = "not_estimated" // an allowed first call with something to estimate kept no record (Redis away or failed)
	idCorrected    = "corrected"     // a second call corrected the estimate
	idNotCorrected = "not_corrected" // a response-time call with Redis away, or its claim or a counter's move failed
	idUnmatched    = "unmatched"     // a response-time call found no estimate and charged its hits in full
)

var idResults = []string{idEstimated, idNotEstimated, idCorrected, idNotCorrected, idUnmatched}

// newIDCounter registers the counter of request id outcomes on reg (when
// not nil), every result starting at zero.
func newIDCounter(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_admission_rls_request_ids_total",
		Help: "ShouldRateLimit calls with a request id (QF_ENVOY_REQUEST_ID_KEY, QF_ENVOY_ACTUAL_ID_KEY), by what they did (estimated, not_estimated, corrected, not_corrected, unmatched).",
	}, []string{"result"})
	for _, r := range idResults {
		c.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(c)
	}
	return c
}

// claimedMark is a record's value once its response-time call claimed it.
const claimedMark = "claimed"

// record is the estimate of one request: per counter id (decide.Charge.ID),
// its hits, the end of the window they were counted in (Unix ms, by this
// host's clock) and the window's length (ms): a reload that changes the
// window moves the counter to another key, which the estimate never
// charged. At is the Redis time of its decision (Unix ms), which dates the
// give-backs; zero in a record an earlier version wrote, whose estimate is
// then never given back.
type record struct {
	Counters map[string][3]int64 `json:"c"`
	At       int64               `json:"t,omitempty"`
}

// readRecord decodes a claimed record: Redis's, written by any instance
// and version of admission.
func readRecord(b string) (*record, error) {
	var rec record
	if err := json.Unmarshal([]byte(b), &rec); err != nil {
		return nil, err
	}
	if rec.At < 0 || rec.At >= 1<<47 {
		return nil, fmt.Errorf("decision time %d: want 0 to 2^47 ms", rec.At)
	}
	for _, est := range rec.Counters {
		if est[0] < 0 || est[1] <= 0 || est[2] <= 0 {
			return nil, fmt.Errorf("estimate %v: want hits, a window end and a window length", est)
		}
	}
	return &rec, nil
}

// requestID takes the entries of the request and actual id keys out of ds
// and returns the descriptors without them (ds itself when none has one),
// the id, and whether the call is the response-time one (the actual id
// key's). Every such entry must be of the same key and carry the same
// valid id. A descriptor left without entries matches no limit.
func (h *Handler) requestID(ds []*rlv3.RateLimitDescriptor) (_ []*rlv3.RateLimitDescriptor, id string, actual bool, _ error) {
	isID := func(e *rlv3.RateLimitDescriptor_Entry) bool {
		return e.GetKey() == h.idKey || e.GetKey() == h.actualKey
	}
	if h.idKey == "" || !slices.ContainsFunc(ds, func(d *rlv3.RateLimitDescriptor) bool {
		return slices.ContainsFunc(d.GetEntries(), isID)
	}) {
		return ds, "", false, nil
	}
	out := make([]*rlv3.RateLimitDescriptor, len(ds))
	key := ""
	for i, d := range ds {
		var keep []*rlv3.RateLimitDescriptor_Entry
		for j, e := range d.GetEntries() {
			if !isID(e) {
				keep = append(keep, e)
				continue
			}
			field := fmt.Sprintf("descriptors[%d].entries[%d]", i, j)
			switch v := e.GetValue(); {
			case key != "" && e.GetKey() != key:
				return nil, "", false, fmt.Errorf("%s.key: %q and %q in one request: a call is either the request-time or the response-time one", field, key, e.GetKey())
			case v == "":
				return nil, "", false, fmt.Errorf("%s.value: request id: empty", field)
			case ident.Check(v) != nil:
				return nil, "", false, fmt.Errorf("%s.value: request id: %w", field, ident.Check(v))
			case id == "":
				id, key = v, e.GetKey()
			case v != id:
				return nil, "", false, fmt.Errorf("%s.value: request id %q differs from %q", field, v, id)
			}
		}
		out[i] = d
		if len(keep) < len(d.GetEntries()) {
			out[i] = &rlv3.RateLimitDescriptor{Entries: keep, Limit: d.GetLimit(), HitsAddend: d.GetHitsAddend()}
		}
	}
	return out, id, key == h.actualKey, nil
}

// recordKey is the key of a request's record: the request id, scoped by
// the domain and the subject (tenant and user) its descriptors name, so
// that a token bound to a tenant, which may only charge descriptors of that
// tenant, never reaches another tenant's request, and a user's request id
// never another user's. Hashed: the parts may hold any character, and the
// key stays short; "qrls:" is outside the engine's key layout.
func recordKey(domain, tenant, user, id string) string {
	h := sha256.New()
	for _, s := range [4]string{domain, tenant, user, id} {
		h.Write([]byte(strconv.Itoa(len(s)) + ":" + s))
	}
	return "qrls:" + hex.EncodeToString(h.Sum(nil)[:16])
}

// correlated answers a call that names a request (key: recordKey): its
// request-time call, or its response-time call when actual.
func (h *Handler) correlated(ctx context.Context, key string, actual bool, items []item, charges []decide.Charge) (*rlspb.RateLimitResponse, error) {
	if deg, _ := h.correct.Degraded(); deg {
		// Redis is away: decided locally as any call, and nothing is kept
		// (nor corrected, for a response-time call).
		resp, res, err := h.decide(ctx, items, charges)
		switch {
		case err != nil:
		case actual:
			h.ids.WithLabelValues(idNotCorrected).Inc()
		case res.Allowed && estimable(items):
			h.ids.WithLabelValues(idNotEstimated).Inc()
		}
		return resp, err
	}
	if !actual {
		resp, res, err := h.decide(ctx, items, charges)
		switch {
		case err != nil || !res.Allowed || !estimable(items):
			// Denied, or nothing to estimate: not counted.
		case !res.Local && len(res.Limits) > 0 && h.keep(ctx, key, items, charges, &res):
			h.ids.WithLabelValues(idEstimated).Inc()
		default:
			h.ids.WithLabelValues(idNotEstimated).Inc()
		}
		return resp, err
	}
	cctx, cancel := context.WithTimeout(ctx, h.timeout)
	old, err := h.records.SetArgs(cctx, key, claimedMark, redis.SetArgs{Mode: "XX", KeepTTL: true, Get: true}).Result()
	cancel()
	switch {
	case errors.Is(err, redis.Nil) || err == nil && old == claimedMark:
		// No estimate of this request left to correct: the actual is
		// charged in full, as new usage.
		result := idUnmatched
		if !h.settle(ctx, nil, items, charges) {
			result = idNotCorrected
		}
		h.ids.WithLabelValues(result).Inc()
		return h.current(ctx, items, charges, false)
	case err != nil:
		// The claim failed: decided as any call (locally, if Redis is
		// down), and the estimate stays (a claim that ran although its
		// reply was lost leaves it too: corrections are at most once).
		h.log.Debug("claim request record", "err", err)
		h.ids.WithLabelValues(idNotCorrected).Inc()
		resp, _, err := h.decide(ctx, items, charges)
		return resp, err
	}
	result := idNotCorrected
	if rec, err := readRecord(old); err != nil {
		h.log.Error("request record unreadable; not corrected", "err", err)
	} else if h.settle(ctx, rec, items, charges) {
		result = idCorrected
	}
	h.ids.WithLabelValues(result).Inc()
	return h.current(ctx, items, charges, true)
}

// estimable reports whether a call charges a counter whose hits an estimate
// keeps: of a limit that lets hits through (requests_per_unit 0 passes
// only a check of none; an unlimited descriptor is not charged).
func estimable(items []item) bool {
	for i := range items {
		if items[i].charge >= 0 && items[i].limit.RequestsPerUnit != 0 {
			return true
		}
	}
	return false
}

// keep records what an allowed first call charged (res) as its estimate,
// and reports whether it did.
func (h *Handler) keep(ctx context.Context, key string, items []item, charges []decide.Charge, res *decide.Result) bool {
	// The windows' ends are judged by this host's clock (correction); the
	// give-backs are dated by Redis's (res.Now).
	rec := record{Counters: map[string][3]int64{}, At: res.Now.UnixMilli()}
	now := time.Now()
	last := now
	var longest time.Duration
	for i := range items {
		it := &items[i]
		if !estimable(items[i:i+1]) || it.charge >= len(res.Limits) {
			continue
		}
		c := &charges[it.charge]
		end := windowEnd(now, res.Limits[it.charge].Reset, it.limit.Window)
		v := rec.Counters[c.ID]
		v[0] += it.hits
		v[1], v[2] = end.UnixMilli(), it.limit.Window.Milliseconds()
		rec.Counters[c.ID] = v
		last, longest = later(last, end), max(longest, it.limit.Window)
	}
	if len(rec.Counters) == 0 {
		return false
	}
	b, err := json.Marshal(&rec)
	if err != nil {
		h.log.Error("encode request record", "err", err)
		return false
	}
	// The record outlives its windows by one window, so that a late
	// response-time call still finds it and charges its actual in full;
	// then it is gone, and such a call is a first call.
	ttl := min(h.ttl, last.Sub(now)+longest)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.timeout)
	defer cancel()
	if err := h.records.SetArgs(cctx, key, b, redis.SetArgs{Mode: "NX", TTL: ttl}).Err(); err != nil {
		// Without its record (redis.Nil: the id has a record already, a
		// reused id's), this request's response-time call corrects that
		// record, if it comes first, or is charged in full.
		h.log.Debug("keep request record", "err", err)
		return false
	}
	return true
}

// settle moves each counter of rec that the call names by the call's hits
// minus the estimate (the hits in full when the estimate's window passed or
// its rule's window changed; a give-back dated at rec.At, none when rec
// has no date), or, without rec, each counter the call names by its hits,
// and reports whether every move was made.
func (h *Handler) settle(ctx context.Context, rec *record, items []item, charges []decide.Charge) bool {
	actual := map[string]int64{}
	first := map[string]int{}
	for i := range items {
		it := &items[i]
		if !estimable(items[i : i+1]) {
			continue
		}
		id := charges[it.charge].ID
		if _, ok := rec.estimate(id); rec != nil && !ok {
			continue
		}
		if _, ok := first[id]; !ok {
			first[id] = it.charge
		}
		actual[id] += it.hits
	}
	now, ok := time.Now(), true
	for id, hits := range actual {
		c := &charges[first[id]]
		delta, at := hits, time.Time{}
		if est, found := rec.estimate(id); found && est[2] == time.Duration(c.Rules[0].Window).Milliseconds() {
			delta = correction(hits, est, now)
		}
		switch {
		case delta < 0 && rec.At == 0:
			// An earlier version's record: a give-back it cannot date
			// is not made, and the estimate stays counted.
			continue
		case delta < 0:
			// Dated in the estimate's decision: this host's clock cannot
			// vouch for the window Redis is in when the move runs (a
			// stall, a move that timed out here and ran there), and Redis
			// takes nothing from a later window's usage.
			at = time.UnixMilli(rec.At)
		case delta == 0:
			continue
		}
		if _, err := h.correct.Adjust(ctx, *c, delta, at); err != nil {
			h.log.Warn("charge a response-time cost; an estimate stays or the actual is not counted", "err", err)
			ok = false
		}
	}
	return ok
}

// estimate is rec's estimate of counter id; none when rec is nil.
func (rec *record) estimate(id string) ([3]int64, bool) {
	if rec == nil {
		return [3]int64{}, false
	}
	est, ok := rec.Counters[id]
	return est, ok
}

// correction is what a counter moves by at now for an actual of hits,
// against est (the estimate's hits and its window's end, Unix ms): the
// difference while the estimate's window is current, the actual in full
// once it passed (or is about to: windowGuard).
func correction(hits int64, est [3]int64, now time.Time) int64 {
	if now.Before(time.UnixMilli(est[1]).Add(-windowGuard)) {
		return hits - est[0]
	}
	return hits
}

// current answers a response-time call: its counters as they are (a check
// of no hits), OK when ok.
func (h *Handler) current(ctx context.Context, items []item, charges []decide.Charge, ok bool) (*rlspb.RateLimitResponse, error) {
	zi := make([]item, len(items))
	for i := range items {
		zi[i] = items[i]
		zi[i].hits = 0
	}
	zc := make([]decide.Charge, len(charges))
	for i := range charges {
		zc[i] = charges[i]
		zc[i].Cost = 0
	}
	resp, _, err := h.decide(ctx, zi, zc)
	if err != nil || !ok {
		return resp, err
	}
	// The request has been let through already: a counter its cost took
	// past the limit is reported with nothing remaining, not as a denial.
	resp.OverallCode = rlspb.RateLimitResponse_OK
	for _, st := range resp.GetStatuses() {
		st.Code = rlspb.RateLimitResponse_OK
	}
	return resp, nil
}

// windowEnd is when the fixed window of a first call's counter ends: its
// reset as Redis reported it, or, when Redis reported none (an empty
// counter checked with no hits), the window's end aligned to the Unix
// epoch, as envoy's and the engine's windows are.
func windowEnd(now time.Time, reset, window time.Duration) time.Time {
	if reset > 0 {
		return now.Add(reset)
	}
	w := window.Milliseconds()
	return time.UnixMilli((now.UnixMilli()/w + 1) * w)
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
