// Package rls is envoy's global rate limit service on admission's gRPC
// server: envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
// (docs/design.md §4), over the limits of an envoyproxy/ratelimit
// configuration (package rlsconf).
//
// # Decisions
//
// Each descriptor the configuration gives a limit becomes a quotaflow fixed
// window of requests_per_unit per unit, counting hits (the descriptor's
// hits_addend when set, zero included, else the request's, else 1). Its
// counter is named by the domain and every entry of the descriptor, as
// envoy's cache key is, under the descriptor's subject: the value of its
// first entry whose key is one of Options.TenantKeys and of its first entry
// whose key is one of Options.UserKeys, or, without a tenant, the domain.
// Each counter is its own Redis key (subject and a hash of the name), so a
// Redis value stays one counter's size however many values a descriptor
// takes. A tenant's counters are kept in the tenant's hash slot, so a
// request's are one script call and one epoch key, as an admit's; those
// without a tenant each have a tag of their own, so a domain spreads over
// a cluster.
//
// A request is one all-or-nothing decision (decide.Decider.Check) inside
// Redis, in a round trip and script call it shares with concurrent
// requests; when any descriptor is over its limit, none is charged.
// Decisions are final: nothing is reserved and nothing is settled later,
// except with Options.RequestIDKey and ActualIDKey, whose response-time
// call of a request corrects its request-time estimate (correlate.go). When Redis is unavailable the
// Decider decides locally, as for POST /v1/admit.
//
// # Replies
//
// Per descriptor: OK or OVER_LIMIT with current_limit, limit_remaining and
// duration_until_reset, as envoy's; unlimited descriptors are OK with
// limit_remaining 4294967295 and no limit, descriptors without a limit OK
// with neither; shadow_mode limits count but are always OK. As in envoy, a
// descriptor is over its limit when the hits of its counter's descriptors
// up to it (a repeated descriptor counts each time) pass what the counter
// had left before the request: a limit of 0 is over for any hit and OK for
// a check of none, and a counter above its limit (a response-time cost)
// is over for any hits, none included. replaces drops the limits a matched limit names. With
// Options.Headers, the reply asks Envoy to add RateLimit-Limit,
// RateLimit-Remaining and RateLimit-Reset of the descriptor with the
// fewest remaining (the last over-limit one when denied), as
// envoyproxy/ratelimit does with LIMIT_RESPONSE_HEADERS_ENABLED.
package rls

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/grpcapi"
	"quotaflow/services/admission/internal/rlsconf"
)

// Bounds of a request. Envoy sends a handful of descriptors of a few entries;
// the bounds keep a hostile caller from making one call costly.
const (
	MaxDescriptors = 64           // descriptors of one request
	MaxEntries     = 32           // entries of one descriptor
	MaxIDBytes     = ident.MaxLen // a domain, key or value
)

// Checker decides a request's charges: *decide.Decider.
type Checker interface {
	Check(ctx context.Context, charges []decide.Charge) (decide.Result, error)
}

// Options configure a Handler. Checker and Config are required.
type Options struct {
	Checker Checker
	// Config returns the configuration in force (Watcher.Current).
	Config func() *rlsconf.Config
	// TenantKeys and UserKeys are the descriptor keys whose values name a
	// descriptor's tenant and user (QF_ENVOY_TENANT_KEYS,
	// QF_ENVOY_USER_KEYS); the first entry with one of them counts.
	TenantKeys, UserKeys []string
	// Headers adds RateLimit-Limit, -Remaining and -Reset to every reply
	// that has a limit (QF_ENVOY_RATELIMIT_HEADERS).
	Headers bool
	// RequestIDKey and ActualIDKey are the descriptor keys whose value
	// names the request in its request-time call (QF_ENVOY_REQUEST_ID_KEY)
	// and in its response-time call (QF_ENVOY_ACTUAL_ID_KEY), both or
	// neither; empty: every call is final. With them, Corrector and Records
	// are required (correlate.go).
	RequestIDKey, ActualIDKey string
	Corrector                 Corrector
	Records                   Records
	// RecordTimeout bounds each Records call (QF_REDIS_TIMEOUT);
	// RecordTTL is the longest a request's estimate waits for its
	// response-time call (QF_RESERVATION_TTL).
	RecordTimeout, RecordTTL time.Duration
	// Registerer takes the request ids' counter
	// (quotaflow_admission_rls_request_ids_total); nil: none registered.
	Registerer prometheus.Registerer
	// Log receives per-request debug lines and errors; nil discards them.
	Log *slog.Logger
}

// Handler serves ShouldRateLimit. Create it with New.
type Handler struct {
	rlspb.UnimplementedRateLimitServiceServer
	check   Checker
	config  func() *rlsconf.Config
	tenants map[string]bool
	users   map[string]bool
	headers bool
	log     *slog.Logger

	idKey     string
	actualKey string
	correct   Corrector
	records   Records
	timeout   time.Duration
	ttl       time.Duration
	ids       *prometheus.CounterVec // by idResults
}

// New returns the handler.
func New(o Options) (*Handler, error) {
	if o.Checker == nil || o.Config == nil {
		return nil, errors.New("rls: Checker and Config are required")
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	h := &Handler{check: o.Checker, config: o.Config, tenants: map[string]bool{}, users: map[string]bool{},
		headers: o.Headers, log: o.Log.With("component", "rls")}
	for _, k := range o.TenantKeys {
		h.tenants[k] = true
	}
	for _, k := range o.UserKeys {
		if h.tenants[k] {
			return nil, fmt.Errorf("rls: key %q names both the tenant and the user", k)
		}
		h.users[k] = true
	}
	if k, a := o.RequestIDKey, o.ActualIDKey; k != "" || a != "" {
		switch {
		case k == "" || a == "" || k == a:
			return nil, errors.New("rls: RequestIDKey and ActualIDKey are two keys, both set or neither")
		case h.tenants[k] || h.users[k] || h.tenants[a] || h.users[a]:
			return nil, fmt.Errorf("rls: key %q or %q names both the request and its tenant or user", k, a)
		case o.Corrector == nil || o.Records == nil:
			return nil, errors.New("rls: a request id key needs Corrector and Records")
		case o.RecordTimeout <= 0 || o.RecordTTL <= 0:
			return nil, errors.New("rls: a request id key needs a positive RecordTimeout and RecordTTL")
		}
		h.idKey, h.actualKey, h.correct, h.records, h.timeout, h.ttl = k, a, o.Corrector, o.Records, o.RecordTimeout, o.RecordTTL
		h.ids = newIDCounter(o.Registerer)
	}
	return h, nil
}

// ruleName is the name of every descriptor's rule: the counter's identity
// is its Endpoint (the domain and the entries).
const ruleName = "rls"

// item is one descriptor of a request, as the handler decides it.
type item struct {
	limit  *rlsconf.Limit // nil: no limit applies
	shared []string       // share_threshold values (rlsconf.Config.Match)
	hits   int64
	charge int // index in the charges (of one rule each), -1 when not charged
	// Set by reply: the charge's limit after the decision (nil when not
	// checked), its counter and the counter's hits up to this descriptor.
	state     *decide.LimitState
	counter   int // its counter's index in reply's
	hitsSoFar int64
}

// ShouldRateLimit answers one request of Envoy's rate limit filter.
func (h *Handler) ShouldRateLimit(ctx context.Context, req *rlspb.RateLimitRequest) (*rlspb.RateLimitResponse, error) {
	if err := validate(req); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	ds, id, actual, err := h.requestID(req.GetDescriptors())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	items, charges, subj, err := h.charges(ctx, req, ds)
	if err != nil {
		return nil, err
	}
	if id != "" && len(charges) > 0 {
		if subj.several {
			return nil, status.Error(codes.InvalidArgument, "descriptors: a request with a request id names one tenant and one user at most")
		}
		return h.correlated(ctx, recordKey(req.GetDomain(), subj.tenant, subj.user, id), actual, items, charges)
	}
	resp, _, err := h.decide(ctx, items, charges)
	return resp, err
}

// requestSubject is the one tenant and user a request's charged
// descriptors name (empty: none); several when they name two tenants or
// two users.
type requestSubject struct {
	tenant, user string
	several      bool
}

// add counts a descriptor's tenant and user (empty: none named).
func (s *requestSubject) add(tenant, user string) {
	if !agree(&s.tenant, tenant) || !agree(&s.user, user) {
		s.several = true
	}
}

// agree reports whether v is empty or *to, or *to empty (then set to v).
func agree(to *string, v string) bool {
	switch {
	case v == "" || v == *to:
		return true
	case *to == "":
		*to = v
		return true
	}
	return false
}

// charges matches descriptors ds of req against the configuration and
// returns them as the handler decides them, the charges of those limited,
// and the subject the charged descriptors name.
func (h *Handler) charges(ctx context.Context, req *rlspb.RateLimitRequest, ds []*rlv3.RateLimitDescriptor) ([]item, []decide.Charge, requestSubject, error) {
	cfg := h.config()
	domain := req.GetDomain()
	items, charges, rules := newCharges(len(ds))
	replaced := map[string]bool{}
	for i, d := range ds {
		l, shared := cfg.Match(domain, d.GetEntries())
		items[i] = item{limit: l, shared: shared, hits: hits(req, d), charge: -1}
		if l := items[i].limit; l != nil {
			for _, r := range l.Replaces {
				replaced[r] = true
			}
		}
	}
	p := grpcapi.Principal(ctx)
	var buf [256]byte // the endpoint of a descriptor, on the stack when short
	var subj requestSubject
	for i, d := range ds {
		it := &items[i]
		l := it.limit
		if l == nil || l.Unlimited || l.Name != "" && replaced[l.Name] {
			continue
		}
		tenant, user := h.subject(d.GetEntries())
		if ok, _ := p.For(tenant); !ok {
			return nil, nil, subj, status.Error(codes.PermissionDenied, "authorization: this token does not allow this request")
		}
		subj.add(tenant, user)
		endpoint := appendEndpoint(buf[:0], domain, d.GetEntries(), it.shared)
		rule, cost := &rules[i], it.hits
		*rule = ruleOf(string(endpoint), l)
		id := counterID(domain, tenant, user, sha256.Sum256(endpoint))
		if l.RequestsPerUnit == 0 {
			// Nothing fits (envoy's 0): a limit of 1 that a cost of 2
			// exceeds denies in Redis without counting anything, and a
			// check of no hits fits, as envoy's counter of 0 is not above 0.
			rule.Limit.Limit = 1
			if cost > 0 {
				cost = 2
			}
			rule.Endpoint += "\x00zero"
		}
		it.charge = len(charges)
		charges = append(charges, decide.Charge{Scope: policy.ScopeGlobal, Tenant: tenant, ID: id, Cost: cost, Rules: rules[i : i+1 : i+1]})
	}
	return items, charges, subj, nil
}

// newCharges returns n items, room for n charges and n rules (one per
// charge): one allocation each, and for a request of one descriptor
// (Envoy's usual) one for the three.
func newCharges(n int) ([]item, []decide.Charge, []policy.Rule) {
	if n == 1 {
		one := new(struct {
			items   [1]item
			charges [1]decide.Charge
			rules   [1]policy.Rule
		})
		return one.items[:], one.charges[:0], one.rules[:]
	}
	return make([]item, n), make([]decide.Charge, 0, n), make([]policy.Rule, n)
}

// decide decides charges, all or nothing, and answers for items. The
// decision is returned by value: a pointer would move it to the heap on
// every call.
func (h *Handler) decide(ctx context.Context, items []item, charges []decide.Charge) (*rlspb.RateLimitResponse, decide.Result, error) {
	res, err := h.check.Check(ctx, charges)
	if err != nil {
		if errors.Is(err, limits.ErrInvalid) {
			return nil, res, status.Error(codes.InvalidArgument, err.Error())
		}
		h.log.Error("should rate limit", "err", err)
		return nil, res, status.Error(codes.Internal, "rate limit decision failed")
	}
	return h.reply(items, charges, &res), res, nil
}

// counter is what the reply knows of one Redis counter of a request: the
// remaining before the request, and the hits of its descriptors so far.
type counter struct {
	id     string
	seen   bool // before is known
	before int64
	hits   int64
}

// reply builds the response from the decision. As envoy adds one
// descriptor's hits after the other's, a descriptor is over when its
// counter's remaining before the request is less than the hits of the
// descriptors of that counter up to it; an allowed request reports the
// remaining after those hits, a denied one (which charged nothing) the
// remaining before the request.
func (h *Handler) reply(items []item, charges []decide.Charge, res *decide.Result) *rlspb.RateLimitResponse {
	// Few descriptors, mostly of distinct counters: a scan finds a counter
	// for less than a map costs, and up to 8 stay on the stack.
	counters := make([]counter, 0, 8)
	for i := range items {
		it := &items[i]
		if it.charge < 0 {
			continue
		}
		c := &charges[it.charge]
		it.counter = slices.IndexFunc(counters, func(ct counter) bool { return ct.id == c.ID })
		if it.counter < 0 {
			it.counter = len(counters)
			counters = append(counters, counter{id: c.ID, before: int64(it.limit.RequestsPerUnit)})
		}
		ct := &counters[it.counter]
		ct.hits += it.hits
		it.hitsSoFar = ct.hits
		k := it.charge // one rule per charge: one state each
		if k >= len(res.Limits) || res.Limits[k].Scope == "" {
			continue
		}
		ls := &res.Limits[k]
		it.state = ls
		// The first charge of the counter (charges are checked in request
		// order) saw it as it was before the request: after its own cost
		// when allowed, as it was when denied or given back.
		if !ct.seen {
			ct.seen, ct.before = true, ls.Remaining
			if res.Allowed {
				ct.before += c.Cost
			}
			ct.before = min(max(ct.before, 0), ls.Limit, int64(it.limit.RequestsPerUnit))
			// A counter that a response-time cost took past its limit
			// (correlate.go) is over even for a check of no hits, as
			// envoy's counter above its limit is.
			if pre := ls.Limit - ls.Used + c.Cost*b2i(res.Allowed); !res.Local && pre < 0 {
				ct.before = pre
			}
		}
	}
	out, msgs := newResponse(len(items))
	out.OverallCode = rlspb.RateLimitResponse_OK
	var minimum *rlspb.RateLimitResponse_DescriptorStatus
	for i := range items {
		it, m := &items[i], &msgs[i]
		st := &m.status
		st.Code = rlspb.RateLimitResponse_OK
		out.Statuses[i] = st
		switch {
		case it.limit == nil:
			continue
		case it.limit.Unlimited:
			st.LimitRemaining = math.MaxUint32
			continue
		case it.charge < 0: // replaced
			continue
		}
		m.limit = rlspb.RateLimitResponse_RateLimit{Name: it.limit.Name, RequestsPerUnit: it.limit.RequestsPerUnit, Unit: it.limit.Unit}
		st.CurrentLimit = &m.limit
		ls := it.state
		over := it.limit.RequestsPerUnit == 0 && it.hitsSoFar > 0
		switch {
		case ls != nil:
			before := counters[it.counter].before
			left := before - it.hitsSoFar
			over = over || (!res.Allowed || it.limit.Shadow) && left < 0
			if !res.Allowed {
				left = before
			}
			st.LimitRemaining = uint32(min(max(left, 0), math.MaxUint32))
			m.reset.Seconds = resetSeconds(ls.Reset, it.limit.Window)
			st.DurationUntilReset = &m.reset
		case len(res.Limits) == 0: // allowed unchecked (fail-open)
			st.LimitRemaining = it.limit.RequestsPerUnit
			m.reset.Seconds = resetSeconds(0, it.limit.Window)
			st.DurationUntilReset = &m.reset
		}
		if over {
			st.LimitRemaining = 0
			if !it.limit.Shadow {
				st.Code = rlspb.RateLimitResponse_OVER_LIMIT
				out.OverallCode = rlspb.RateLimitResponse_OVER_LIMIT
			}
		}
		// As envoy: the last descriptor over its limit, else the first with
		// the fewest remaining.
		if minimum == nil || st.LimitRemaining < minimum.LimitRemaining || st.Code == rlspb.RateLimitResponse_OVER_LIMIT {
			minimum = st
		}
	}
	if h.headers && minimum != nil {
		hv := new([3]corev3.HeaderValue) // one allocation for the three
		hv[0].Key, hv[0].Value = "RateLimit-Limit", strconv.FormatUint(uint64(minimum.CurrentLimit.GetRequestsPerUnit()), 10)
		hv[1].Key, hv[1].Value = "RateLimit-Remaining", strconv.FormatUint(uint64(minimum.LimitRemaining), 10)
		hv[2].Key, hv[2].Value = "RateLimit-Reset", strconv.FormatInt(minimum.DurationUntilReset.GetSeconds(), 10)
		out.ResponseHeadersToAdd = []*corev3.HeaderValue{&hv[0], &hv[1], &hv[2]}
	}
	return out
}

// newResponse returns a response with n statuses, each to be pointed at
// its descriptor's messages, also returned: the messages of every
// descriptor in one allocation, and a request of one descriptor (Envoy's
// usual) all of it in one.
func newResponse(n int) (*rlspb.RateLimitResponse, []statusMessages) {
	if n == 1 {
		one := new(struct {
			out      rlspb.RateLimitResponse
			statuses [1]*rlspb.RateLimitResponse_DescriptorStatus
			msgs     [1]statusMessages
		})
		one.out.Statuses = one.statuses[:]
		return &one.out, one.msgs[:]
	}
	return &rlspb.RateLimitResponse{Statuses: make([]*rlspb.RateLimitResponse_DescriptorStatus, n)}, make([]statusMessages, n)
}

// statusMessages are the messages of one descriptor's status.
type statusMessages struct {
	status rlspb.RateLimitResponse_DescriptorStatus
	limit  rlspb.RateLimitResponse_RateLimit
	reset  durationpb.Duration
}

// resetSeconds is a window's time until reset in whole seconds, rounded up
// as envoy's (1 to the window's seconds); without a reset from Redis, the
// window's length.
func resetSeconds(reset, window time.Duration) int64 {
	if reset <= 0 {
		reset = window
	}
	return int64((reset + time.Second - 1) / time.Second)
}

// hits is the descriptor's hit count: its own hits_addend when set (zero
// included: a check that counts nothing), else the request's, else 1.
func hits(req *rlspb.RateLimitRequest, d *rlv3.RateLimitDescriptor) int64 {
	if a := d.GetHitsAddend(); a != nil {
		return int64(a.GetValue())
	}
	return int64(max(1, req.GetHitsAddend()))
}

// subject returns the tenant and user the entries name.
func (h *Handler) subject(entries []*rlv3.RateLimitDescriptor_Entry) (tenant, user string) {
	if len(h.tenants) == 0 {
		return "", ""
	}
	for _, e := range entries {
		switch {
		case tenant == "" && h.tenants[e.GetKey()]:
			tenant = e.GetValue()
		case user == "" && h.users[e.GetKey()]:
			user = e.GetValue()
		}
	}
	if tenant == "" {
		user = ""
	}
	return tenant, user
}

// counterID is the shared scope id of one descriptor counter: its subject
// (tenant and user, or the domain), then a hash of its endpoint (the domain
// and entries), unambiguous (length-prefixed) and at most limits.MaxID bytes
// (a longer one is its SHA-256). Each counter is a Redis string and a local
// owner of its own, so a value that varies (a client address) adds keys of
// a few dozen bytes each, never records to one growing string.
// The caller hashes the endpoint: sum is its SHA-256.
func counterID(domain, tenant, user string, sum [sha256.Size]byte) string {
	var buf [2*MaxIDBytes + 64]byte // one allocation: the string
	var id []byte
	if tenant == "" {
		id = appendField(append(buf[:0], 'd'), domain)
	} else {
		id = appendField(append(appendField(append(buf[:0], 't'), tenant), 'u'), user)
	}
	id = hex.AppendEncode(append(id, 'c'), sum[:16])
	if len(id) > limits.MaxID {
		long := sha256.Sum256(id)
		return "h:" + hex.EncodeToString(long[:])
	}
	return string(id)
}

// appendField appends s length-prefixed: its length, ':' and s.
func appendField(b []byte, s string) []byte {
	return append(append(strconv.AppendInt(b, int64(len(s)), 10), ':'), s...)
}

// appendEndpoint appends a descriptor's endpoint: the domain and every
// entry (envoy's cache key, length-prefixed), with a share_threshold
// wildcard in place of the value it matched.
func appendEndpoint(b []byte, domain string, entries []*rlv3.RateLimitDescriptor_Entry, shared []string) []byte {
	b = appendField(b, domain)
	for i, e := range entries {
		v := e.GetValue()
		if i < len(shared) && shared[i] != "" {
			v = shared[i]
		}
		b = appendField(appendField(b, e.GetKey()), v)
	}
	return b
}

// ruleOf is the rule of a descriptor: a fixed window of hits, named by its
// endpoint (appendEndpoint).
func ruleOf(endpoint string, l *rlsconf.Limit) policy.Rule {
	return policy.Rule{
		Limit: policy.Limit{Name: ruleName, Kind: policy.Fixed, Unit: policy.Tokens,
			Limit: int64(l.RequestsPerUnit), Window: policy.Duration(l.Window), Shadow: l.Shadow},
		Scope:    policy.ScopeGlobal,
		Endpoint: endpoint,
	}
}

// validate checks a request as a hostile caller may send it.
func validate(req *rlspb.RateLimitRequest) error {
	if err := checkID(req.GetDomain()); err != nil {
		return fmt.Errorf("domain: %w", err)
	}
	ds := req.GetDescriptors()
	switch {
	case len(ds) == 0:
		return errors.New("descriptors: empty")
	case len(ds) > MaxDescriptors:
		return fmt.Errorf("descriptors: %d, more than %d", len(ds), MaxDescriptors)
	}
	for i, d := range ds {
		es := d.GetEntries()
		switch {
		case len(es) == 0:
			return fmt.Errorf("descriptors[%d].entries: empty", i)
		case len(es) > MaxEntries:
			return fmt.Errorf("descriptors[%d].entries: %d, more than %d", i, len(es), MaxEntries)
		}
		for j, e := range es {
			// The field's name is formatted only for an error.
			if err := checkID(e.GetKey()); err != nil {
				return fmt.Errorf("descriptors[%d].entries[%d].key: %w", i, j, err)
			}
			if err := checkValue(e.GetValue()); err != nil {
				return fmt.Errorf("descriptors[%d].entries[%d].value: %w", i, j, err)
			}
		}
		if a := d.GetHitsAddend(); a != nil && a.GetValue() > limits.MaxCost {
			return fmt.Errorf("descriptors[%d].hits_addend: more than %d", i, int64(limits.MaxCost))
		}
		if d.GetLimit() != nil {
			return fmt.Errorf("descriptors[%d].limit: limit overrides are not supported", i)
		}
		// A refill would let a caller erase usage it was charged.
		if d.GetIsNegativeHits() {
			return fmt.Errorf("descriptors[%d].is_negative_hits: refills are not supported: a caller cannot give back hits", i)
		}
	}
	return nil
}

// errEmpty is a required domain or key that is empty.
var errEmpty = errors.New("empty")

// checkID checks a required domain or key.
func checkID(s string) error {
	if s == "" {
		return errEmpty
	}
	return checkValue(s)
}

// checkValue checks a value (which may be empty) as the decider checks a
// tenant, user or id (ident.Check: at most MaxIDBytes of UTF-8 without
// control characters, C1 included), so that a value naming a tenant is
// refused here, naming its field, rather than by the decider.
func checkValue(s string) error {
	return ident.Check(s)
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
