package rls

// Response-time costs (docs/design.md §4, gRPC). Envoy can report a
// request's cost twice: at request time (an estimate, or hits_addend 0) and
// when the response ends (the rate limit action's apply_on_stream_done, with
// hits_addend from dynamic metadata such as the used tokens). With
// Options.RequestIDKey, the descriptors' entries of that key name the
// request, and the two calls are correlated through a record in Redis:
//
//   - a call whose (domain, tenant, request id) has no record is decided as
//     any call; when it is allowed by Redis, what it charged each counter
//     is the request's estimate, kept in a record until the longest of
//     those windows ends plus one window (at most Options.RecordTTL);
//   - the next call of the id claims the record (SET XX KEEPTTL GET: one
//     claimant, and the record becomes a mark) and moves each counter the
//     first call charged that it names by its own hits (the actual) minus
//     the estimate, with decide's Adjust, never refused by a limit; a
//     counter whose estimate window has passed (or is within windowGuard
//     of its end) is charged the actual in full instead, in its current
//     window. Counters it names that the first call did not charge, and
//     counters the first charged that it does not name, do not move;
//   - a call finding the mark changes nothing.
//
// Both later kinds answer OK with the counters' state (a check of no hits;
// a counter past its limit has 0 remaining): Envoy ignores the answer of an
// apply_on_stream_done call.
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
	Adjust(ctx context.Context, c decide.Charge, amount int64) ([]decide.LimitState, error)
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
// Redis reset (possibly another instance's), and a give-back landing in
// the next window would give credit that was never taken. Clocks under
// NTP agree to well within it.
const windowGuard = time.Second

// The result label values of quotaflow_admission_rls_request_ids_total:
// what a call with a request id did.
const (
	idEstimated    = "estimated"     // a first call's estimate was kept
	idNotEstimated = "not_estimated" // an allowed first call kept no record (Redis away or failed)
	idCorrected    = "corrected"     // a second call corrected the estimate
	idNotCorrected = "not_corrected" // a second call's claim, or a counter's correction, failed
	idRepeated     = "repeated"      // a later call found the request corrected
)

var idResults = []string{idEstimated, idNotEstimated, idCorrected, idNotCorrected, idRepeated}

// newIDCounter registers the counter of request id outcomes on reg (when
// not nil), every result starting at zero.
func newIDCounter(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_admission_rls_request_ids_total",
		Help: "ShouldRateLimit calls with a request id (QF_ENVOY_REQUEST_ID_KEY), by what they did (estimated, not_estimated, corrected, not_corrected, repeated).",
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
// its hits and the end of the window they were counted in (Unix ms).
type record struct {
	Counters map[string][2]int64 `json:"c"`
}

// requestID takes the entries of the request id key out of ds and returns
// the descriptors without them (ds itself when none has one) and the id.
// Every entry of the key must carry the same valid id. A descriptor left
// without entries matches no limit.
func (h *Handler) requestID(ds []*rlv3.RateLimitDescriptor) ([]*rlv3.RateLimitDescriptor, string, error) {
	if h.idKey == "" || !slices.ContainsFunc(ds, func(d *rlv3.RateLimitDescriptor) bool {
		return slices.ContainsFunc(d.GetEntries(), func(e *rlv3.RateLimitDescriptor_Entry) bool { return e.GetKey() == h.idKey })
	}) {
		return ds, "", nil
	}
	out := make([]*rlv3.RateLimitDescriptor, len(ds))
	id := ""
	for i, d := range ds {
		var keep []*rlv3.RateLimitDescriptor_Entry
		for j, e := range d.GetEntries() {
			if e.GetKey() != h.idKey {
				keep = append(keep, e)
				continue
			}
			field := fmt.Sprintf("descriptors[%d].entries[%d].value", i, j)
			switch v := e.GetValue(); {
			case v == "":
				return nil, "", fmt.Errorf("%s: request id: empty", field)
			case ident.Check(v) != nil:
				return nil, "", fmt.Errorf("%s: request id: %w", field, ident.Check(v))
			case id == "":
				id = v
			case v != id:
				return nil, "", fmt.Errorf("%s: request id %q differs from %q", field, v, id)
			}
		}
		out[i] = d
		if len(keep) < len(d.GetEntries()) {
			out[i] = &rlv3.RateLimitDescriptor{Entries: keep, Limit: d.GetLimit(), HitsAddend: d.GetHitsAddend()}
		}
	}
	return out, id, nil
}

// recordKey is the key of a request's record: the request id, scoped by
// the domain and the tenant its descriptors name, so that a token bound to
// a tenant, which may only charge descriptors of that tenant, never reaches
// another tenant's request. Hashed: the parts may hold any character, and
// the key stays short; "qrls:" is outside the engine's key layout.
func recordKey(domain, tenant, id string) string {
	h := sha256.New()
	for _, s := range [3]string{domain, tenant, id} {
		h.Write([]byte(strconv.Itoa(len(s)) + ":" + s))
	}
	return "qrls:" + hex.EncodeToString(h.Sum(nil)[:16])
}

// correlated answers a call that names a request (key: recordKey).
func (h *Handler) correlated(ctx context.Context, key string, items []item, charges []decide.Charge) (*rlspb.RateLimitResponse, error) {
	if deg, _ := h.correct.Degraded(); deg {
		// Redis is away: decided locally as any call, and nothing is kept
		// (nor corrected, if it was a second call).
		resp, res, err := h.decide(ctx, items, charges)
		if err == nil && res.Allowed {
			h.ids.WithLabelValues(idNotEstimated).Inc()
		}
		return resp, err
	}
	cctx, cancel := context.WithTimeout(ctx, h.timeout)
	old, err := h.records.SetArgs(cctx, key, claimedMark, redis.SetArgs{Mode: "XX", KeepTTL: true, Get: true}).Result()
	cancel()
	switch {
	case errors.Is(err, redis.Nil): // the first call: an estimate
		resp, res, err := h.decide(ctx, items, charges)
		switch {
		case err != nil || !res.Allowed:
		case !res.Local && len(res.Limits) > 0 && h.keep(ctx, key, items, charges, res):
			h.ids.WithLabelValues(idEstimated).Inc()
		default:
			h.ids.WithLabelValues(idNotEstimated).Inc()
		}
		return resp, err
	case err != nil:
		// The claim failed: decided as any call (locally, if Redis is
		// down), and the estimate stays (a claim that ran although its
		// reply was lost leaves it too: corrections are at most once).
		h.log.Debug("claim request record", "err", err)
		h.ids.WithLabelValues(idNotCorrected).Inc()
		resp, _, err := h.decide(ctx, items, charges)
		return resp, err
	case old == claimedMark:
		h.ids.WithLabelValues(idRepeated).Inc()
	default:
		var rec record
		result := idNotCorrected
		if err := json.Unmarshal([]byte(old), &rec); err != nil {
			h.log.Error("request record unreadable; not corrected", "err", err)
		} else if h.settle(ctx, &rec, items, charges) {
			result = idCorrected
		}
		h.ids.WithLabelValues(result).Inc()
	}
	return h.current(ctx, items, charges)
}

// keep records what an allowed first call charged (res) as its estimate,
// and reports whether it did.
func (h *Handler) keep(ctx context.Context, key string, items []item, charges []decide.Charge, res *decide.Result) bool {
	rec := record{Counters: map[string][2]int64{}}
	now := res.Now
	last := now
	var longest time.Duration
	for i := range items {
		it := &items[i]
		if it.charge < 0 || it.limit.RequestsPerUnit == 0 || it.charge >= len(res.Limits) {
			continue
		}
		c := &charges[it.charge]
		end := windowEnd(now, res.Limits[it.charge].Reset, it.limit.Window)
		v := rec.Counters[c.ID]
		v[0] += it.hits
		v[1] = end.UnixMilli()
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
		// Without its record (redis.Nil: a concurrent first call of the
		// same id kept its own), this request's next call is charged as a
		// first call.
		h.log.Debug("keep request record", "err", err)
		return false
	}
	return true
}

// settle moves each counter of rec that the call names by the call's hits
// minus the estimate (the hits in full when the estimate's window passed),
// and reports whether every move was made.
func (h *Handler) settle(ctx context.Context, rec *record, items []item, charges []decide.Charge) bool {
	actual := map[string]int64{}
	first := map[string]int{}
	for i := range items {
		it := &items[i]
		if it.charge < 0 || it.limit.RequestsPerUnit == 0 {
			continue
		}
		id := charges[it.charge].ID
		if _, ok := rec.Counters[id]; !ok {
			continue
		}
		if _, ok := first[id]; !ok {
			first[id] = it.charge
		}
		actual[id] += it.hits
	}
	now, ok := time.Now(), true
	for id, hits := range actual {
		delta := correction(hits, rec.Counters[id], now)
		if delta == 0 {
			continue
		}
		if _, err := h.correct.Adjust(ctx, charges[first[id]], delta); err != nil {
			h.log.Warn("correct a counter by a response-time cost; its estimate stays", "err", err)
			ok = false
		}
	}
	return ok
}

// correction is what a counter moves by at now for an actual of hits,
// against est (the estimate's hits and its window's end, Unix ms): the
// difference while the estimate's window is current, the actual in full
// once it passed (or is about to: windowGuard).
func correction(hits int64, est [2]int64, now time.Time) int64 {
	if now.Before(time.UnixMilli(est[1]).Add(-windowGuard)) {
		return hits - est[0]
	}
	return hits
}

// current answers a later call of a request: OK, with its counters as
// they are (a check of no hits).
func (h *Handler) current(ctx context.Context, items []item, charges []decide.Charge) (*rlspb.RateLimitResponse, error) {
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
	if err != nil {
		return nil, err
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
