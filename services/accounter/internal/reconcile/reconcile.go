// Package reconcile compares Redis's token windows with the ledger and
// repairs the drift that is certainly not an event on its way; see
// Reconciler.
package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/obs"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/rebuild"
)

// Ledger is what the reconciliation reads from Postgres, and the lock it
// repairs under.
type Ledger interface {
	UsageSince(ctx context.Context, since time.Time, f func(ledger.Usage) error) error
	UsageOf(ctx context.Context, since time.Time, tenant, user string, f func(ledger.Usage) error) error
	TryLock(ctx context.Context, id int64) (unlock func(), ok bool, err error)
}

// Backlog tells whether events are still on their way into the ledger.
type Backlog interface {
	// Backlog returns how many events the accounter's consumer has yet to
	// deliver or to see acknowledged, and how many deliveries it has made,
	// a count that moves with every message handed out.
	Backlog(ctx context.Context) (pending, delivered uint64, err error)
}

// ConsumerBacklog is the Backlog of the accounter's durable JetStream
// consumer, which every instance shares.
type ConsumerBacklog struct{ Consumer jetstream.Consumer }

// Backlog reads the consumer's info from the server.
func (b ConsumerBacklog) Backlog(ctx context.Context) (pending, delivered uint64, err error) {
	info, err := b.Consumer.Info(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("consumer info: %w", err)
	}
	return info.NumPending + uint64(max(info.NumAckPending, 0)), info.Delivered.Consumer, nil
}

// reconcileLockID is the Postgres advisory lock an instance holds while it
// repairs, so that two instances never apply the same repair twice
// ("qf-reconc" as a number).
const reconcileLockID = 0x71662d7265636f6e

// Drift is what one Reconcile found and did.
type Drift struct {
	// Subjects is how many subjects were compared: those the ledger holds
	// usage of in the longest window and those Redis holds windows of.
	Subjects int
	// Drifted is how many subjects and tenants (for tenant-wide limits)
	// Redis disagrees with the ledger on.
	Drifted int
	// Tokens is the sum over drifted limits of how far Redis's window lies
	// from the ledger's (weighted tokens, either direction).
	Tokens int64
	// Repaired is how many limits were repaired; Raised and Lowered the
	// tokens added to and taken from their windows.
	Repaired        int
	Raised, Lowered int64
	// Held is how many limits drifted alike in two scans but were left
	// alone because events were in flight when they were measured again.
	Held int
}

// Reconciler compares every token window in Redis (rolling, fixed and
// calendar_month) with what the ledger says it holds, and repairs the
// difference when it is certainly not an event on its way.
//
// What a window should hold, bucket by bucket, is the ledger's usage
// (ledger.Usage: actuals of settled reservations, estimates of open and
// expired ones) under every rule that counted it: a user's limits count
// the user's usage, a tenant-wide limit its users' usage together, an
// endpoint's per-user limit only usage of that endpoint. Redis is read
// bucket by bucket (repair.Tools.WindowsMany), the windows of many owners
// a round trip. A rolling window is exact to one bucket, so its oldest
// bucket is never compared: it leaves within one bucket anyway, and a
// charge made by the accounter later than its event's time (an actual with
// no reservation) may sit one bucket later in Redis.
//
// Redis is legitimately ahead of the ledger by reservations whose events
// are still in the stream, and behind it by releases admission applied
// before their events arrived. A drift is therefore repaired only when
//   - it was seen, bucket for bucket, in two consecutive scans under the
//     same policy;
//   - the consumer has nothing pending or unacknowledged, and delivers
//     nothing while the owner of the drift is measured once more; and
//   - that fresh measurement finds the same drift again.
//
// The repair charges each bucket's difference at the bucket's time
// (repair.Tools.Charge, positive or negative), so the window agrees with the
// ledger and goes on agreeing as it slides. An instance repairs under a
// Postgres advisory lock, and the fresh measurement under it makes a
// second instance find nothing left to repair.
//
// Subjects are found by streaming the ledger and by walking Redis's keys
// with SCAN cursors (repair.ScanSubjects), so windows the ledger has never
// heard of are found too. Repairs hold the rebuild gate. Create a
// Reconciler with New and call Check (or Reconcile) from one goroutine.
type Reconciler struct {
	rep     *repair.Tools
	rdb     redis.UniversalClient
	policy  func() *policy.Policy
	store   Ledger
	backlog Backlog
	gate    *rebuild.Gate
	repair  bool
	log     *slog.Logger
	m       metrics
	// seen holds the drifts of the previous scan, by limit and owner,
	// measured under policy seenUnder.
	seen      map[driftKey]string
	seenUnder *policy.Policy
}

// New returns a Reconciler of rep's Redis, rdb, against store under the
// current policy from policy, its repairs holding gate. With repair false
// it only measures. Check logs to log and reports on reg (nil: not
// registered) in the quotaflow_accounter_drift_*, _reconciliations_total
// and _repaired_tokens_total series.
func New(rep *repair.Tools, rdb redis.UniversalClient, policy func() *policy.Policy, store Ledger, backlog Backlog,
	gate *rebuild.Gate, repair bool, log *slog.Logger, reg prometheus.Registerer) (*Reconciler, error) {
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &Reconciler{rep: rep, rdb: rdb, policy: policy, store: store, backlog: backlog, gate: gate, repair: repair,
		log: log.With("component", "reconcile"), m: m}, nil
}

// metrics are what Check reports.
type metrics struct {
	driftTokens, driftSubjects prometheus.Gauge
	passes, repaired           *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (metrics, error) {
	m := metrics{
		driftTokens: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "quotaflow_accounter_drift_tokens",
			Help: "Weighted tokens by which Redis's token windows lie outside the ledger's usage, summed over subjects and limits, at the last reconciliation (reservations still in the stream count too).",
		}),
		driftSubjects: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "quotaflow_accounter_drift_subjects",
			Help: "Subjects, and tenants for tenant-wide limits, whose Redis windows disagreed with the ledger at the last reconciliation.",
		}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_accounter_reconciliations_total",
			Help: "Reconciliation passes of Redis's token windows against the ledger, by result (ok, error).",
		}, []string{"result"}),
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_accounter_repaired_tokens_total",
			Help: "Weighted tokens the reconciliation added to (raised) or took from (lowered) Redis's token windows to agree with the ledger.",
		}, []string{"direction"}),
	}
	m.passes.WithLabelValues("ok")
	m.passes.WithLabelValues("error")
	m.repaired.WithLabelValues("raised")
	m.repaired.WithLabelValues("lowered")
	if err := obs.Register(reg, m.driftTokens, m.driftSubjects, m.passes, m.repaired); err != nil {
		return m, fmt.Errorf("reconcile: register metrics: %w", err)
	}
	return m, nil
}

// Check reconciles once (Reconcile) and reports what it found: the drift
// gauges, the passes and the repaired tokens, and a warning while Redis
// drifts. A failure is logged and counted; the next call tries again. The
// accounter calls it every QF_RECONCILE_INTERVAL.
func (r *Reconciler) Check(ctx context.Context) {
	d, err := r.Reconcile(ctx)
	r.m.repaired.WithLabelValues("raised").Add(float64(d.Raised))
	r.m.repaired.WithLabelValues("lowered").Add(float64(d.Lowered))
	if err != nil {
		r.m.passes.WithLabelValues("error").Inc()
		r.log.Error("reconciling redis with the ledger failed", "err", err)
		return
	}
	r.m.passes.WithLabelValues("ok").Inc()
	r.m.driftTokens.Set(float64(d.Tokens))
	r.m.driftSubjects.Set(float64(d.Drifted))
	if d.Drifted > 0 {
		r.log.Warn("redis drifts from the ledger", "subjects", d.Subjects, "drifted", d.Drifted, "tokens", d.Tokens,
			"repaired_limits", d.Repaired, "raised", d.Raised, "lowered", d.Lowered, "held_in_flight", d.Held)
	}
}

// owner is whose counter a window is: a subject, or a tenant (user empty)
// for tenant-wide limits.
type owner struct{ tenant, user string }

// limitID is what names a limit's counter in Redis (limits' ruleID): its
// size may change without touching the counter.
type limitID struct {
	scope          policy.Scope
	endpoint, name string
	kind           policy.Kind
	window         policy.Duration
	buckets        int
}

func idOf(r *policy.Rule) limitID {
	return limitID{r.Scope, r.Endpoint, r.Name, r.Kind, r.Window, r.Buckets}
}

type driftKey struct {
	owner
	limitID
}

// tally is what the ledger puts in each bucket (repair.BucketOf) of each
// limit of one owner.
type tally map[bucket]int64

// bucket names bucket n of a limit.
type bucket struct {
	limitID
	n int64
}

func (t tally) add(r *policy.Rule, n, tokens int64) {
	t[bucket{idOf(r), n}] += tokens
}

// drift is one limit of one owner that Redis disagrees on: fix holds, per
// bucket, what to add to Redis to agree.
type drift struct {
	key  driftKey
	rule policy.Rule
	fix  []fix
	net  int64
}

// fix is what to add to bucket n of a window (negative: take away).
type fix struct{ n, tokens int64 }

// fingerprint names a drift exactly, bucket by bucket, to compare scans.
func (d *drift) fingerprint() string {
	var b strings.Builder
	for _, f := range d.fix {
		b.WriteString(strconv.FormatInt(f.n, 10))
		b.WriteByte(':')
		b.WriteString(strconv.FormatInt(f.tokens, 10))
		b.WriteByte(' ')
	}
	return b.String()
}

// scan is the state of one Reconcile.
type scan struct {
	policy *policy.Policy // one policy for the whole scan
	now    time.Time
	since  time.Time
	// rules caches the windowed token rules by tenant, plan and endpoint;
	// candidates every such rule a tenant's windows may hold.
	rules      map[[3]string][]policy.Rule
	candidates map[string][2][]policy.Rule // user rules, tenant rules
}

// Reconcile compares every subject's and tenant's token windows with the
// ledger, repairs the drift that is safe to repair (see the type's doc)
// and reports what it found and did.
func (r *Reconciler) Reconcile(ctx context.Context) (Drift, error) {
	var d Drift
	p := r.policy()
	w := p.LongestTokenWindow()
	if w == 0 {
		r.seen = nil
		return d, nil
	}
	now := time.Now()
	s := &scan{policy: p, now: now, since: now.Add(-w), rules: map[[3]string][]policy.Rule{}, candidates: map[string][2][]policy.Rule{}}

	// Redis's blobs first, so that a window with no usage in the ledger
	// is compared too.
	inRedis := map[owner]bool{}
	anyUser := map[string]string{} // a user of each tenant, to address its blob
	err := repair.ScanSubjects(ctx, r.rdb, func(tenant, user string) {
		inRedis[owner{tenant, user}] = true
		if user != "" {
			anyUser[tenant] = user
		}
	})
	if err != nil {
		r.seen = nil
		return d, fmt.Errorf("reconcile: %w", err)
	}

	// Owners are measured in chunks, their windows read in one pipelined
	// round trip per chunk: a round trip per subject would make the scan
	// as slow as Redis's latency times the subjects. A chunk's tallies are
	// cleared and reused, sparing the allocation of a map per owner.
	var found []drift
	chunk := make([]measurement, 0, readChunk)
	var spare []tally
	newTally := func() tally {
		if len(spare) == 0 {
			return tally{}
		}
		t := spare[len(spare)-1]
		spare = spare[:len(spare)-1]
		return t
	}
	flush := func() error {
		dss, err := r.compare(ctx, s, chunk)
		if err != nil {
			return err
		}
		for _, ds := range dss {
			if len(ds) > 0 {
				d.Drifted++
			}
			for _, x := range ds {
				d.Tokens += abs(x.net)
			}
			found = append(found, ds...)
		}
		for _, m := range chunk {
			clear(m.t)
			spare = append(spare, m.t)
		}
		chunk = chunk[:0]
		return nil
	}
	measure := func(o owner, keyUser string, t tally) error {
		if o.user != "" {
			d.Subjects++
		}
		delete(inRedis, o)
		chunk = append(chunk, measurement{o, keyUser, t})
		if len(chunk) < readChunk {
			return nil
		}
		return flush()
	}

	// The ledger, subject by subject: each subject's limits when the
	// subject ends, the tenant-wide ones when the tenant ends.
	var cur owner
	users, tenants := newTally(), newTally()
	err = r.store.UsageSince(ctx, s.since, func(u ledger.Usage) error {
		if cur.tenant != "" && (u.Tenant != cur.tenant || u.User != cur.user) {
			if err := measure(cur, cur.user, users); err != nil {
				return err
			}
			users = newTally()
			if u.Tenant != cur.tenant {
				if err := measure(owner{cur.tenant, ""}, cur.user, tenants); err != nil {
					return err
				}
				tenants = newTally()
			}
		}
		cur = owner{u.Tenant, u.User}
		return r.count(s, u, users, tenants)
	})
	if err == nil && cur.tenant != "" {
		err = measure(cur, cur.user, users)
		if err == nil {
			err = measure(owner{cur.tenant, ""}, cur.user, tenants)
		}
	}
	// Then what only Redis holds.
	for _, o := range slices.SortedFunc(maps.Keys(inRedis), compareOwners) {
		if err != nil {
			break
		}
		keyUser := o.user
		if keyUser == "" {
			if keyUser = anyUser[o.tenant]; keyUser == "" {
				keyUser = "-" // any name addresses the tenant blob
			}
		}
		err = measure(o, keyUser, newTally())
	}
	if err == nil {
		err = flush()
	}
	if err != nil {
		r.seen = nil // consecutive scans only
		return d, fmt.Errorf("reconcile: %w", err)
	}

	prev := r.seen
	if r.seenUnder != p {
		prev = nil // a reloaded policy may count differently: start again
	}
	r.seen, r.seenUnder = make(map[driftKey]string, len(found)), p
	for i := range found {
		r.seen[found[i].key] = found[i].fingerprint()
	}
	if !r.repair {
		return d, nil
	}
	if err := r.repairStable(ctx, s, found, prev, &d); err != nil {
		return d, fmt.Errorf("reconcile: %w", err)
	}
	return d, nil
}

func compareOwners(a, b owner) int {
	if c := strings.Compare(a.tenant, b.tenant); c != 0 {
		return c
	}
	return strings.Compare(a.user, b.user)
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}

// count adds usage u to the buckets of every windowed token rule that
// counted it, in the subject's or the tenant's tally; usage older than a
// rule's window is left out.
func (r *Reconciler) count(s *scan, u ledger.Usage, users, tenants tally) error {
	rules, err := r.windowRules(s, u.Tenant, u.Plan, u.Endpoint)
	if err != nil {
		return err
	}
	for i := range rules {
		rule := &rules[i]
		n := repair.BucketOf(rule, u.At)
		if n < oldest(rule, s.now) {
			continue
		}
		if rule.Scope == policy.ScopeTenant {
			tenants.add(rule, n, u.Tokens)
		} else {
			users.add(rule, n, u.Tokens)
		}
	}
	return nil
}

// oldest is the number of the oldest bucket rule may still hold around
// now: one bucket before the window, against clock skew from Redis.
func oldest(r *policy.Rule, now time.Time) int64 {
	n := int64(1)
	if r.Kind == policy.Rolling {
		n = int64(max(r.Buckets, 1))
	}
	return repair.BucketOf(r, now) - n
}

// windowRules returns the windowed token rules of tenant on plan for
// endpoint: the ones Windows reads.
func (r *Reconciler) windowRules(s *scan, tenant, plan, endpoint string) ([]policy.Rule, error) {
	k := [3]string{tenant, plan, endpoint}
	if rules, ok := s.rules[k]; ok {
		return rules, nil
	}
	all, err := effects.Rules(s.policy, tenant, plan, endpoint)
	if err != nil {
		return nil, err
	}
	var rules []policy.Rule
	for _, rule := range all {
		if rule.Unit == policy.Tokens && repair.Windowed(&rule) {
			rules = append(rules, rule)
		}
	}
	s.rules[k] = rules
	return rules, nil
}

// candidates returns every windowed token rule tenant's windows may hold,
// whatever plan and endpoint its requests named: its users' limits and
// its tenant-wide ones, each once.
func (r *Reconciler) candidates(s *scan, tenant string) (user, ten []policy.Rule, err error) {
	if c, ok := s.candidates[tenant]; ok {
		return c[0], c[1], nil
	}
	endpoints := append([]string{""}, slices.Sorted(maps.Keys(s.policy.Endpoints))...)
	seen := map[limitID]bool{}
	for _, plan := range slices.Sorted(maps.Keys(s.policy.Plans)) {
		for _, e := range endpoints {
			rules, err := r.windowRules(s, tenant, plan, e)
			if err != nil {
				return nil, nil, err
			}
			for _, rule := range rules {
				if seen[idOf(&rule)] {
					continue
				}
				seen[idOf(&rule)] = true
				if rule.Scope == policy.ScopeTenant {
					ten = append(ten, rule)
				} else {
					user = append(user, rule)
				}
			}
		}
	}
	s.candidates[tenant] = [2][]policy.Rule{user, ten}
	return user, ten, nil
}

// readChunk is how many owners' windows one round trip reads: as many keys
// as a page of repair.ScanSubjects, and with blobs of a kilobyte or so a
// reply of about a megabyte, which Redis buffers for the client.
const readChunk = 1000

// measurement is an owner to compare with tally t: a subject's limits, or
// with o.user empty the tenant-wide ones, read through keyUser's keys.
type measurement struct {
	o       owner
	keyUser string
	t       tally
}

// compare reads the windows of every measurement of ms (one pipelined
// round trip) and returns, for each in order, the limits whose window
// differs from its tally outside the window's oldest bucket.
func (r *Reconciler) compare(ctx context.Context, s *scan, ms []measurement) ([][]drift, error) {
	reqs := make([]repair.WindowsRequest, 0, len(ms))
	read := make([]int, 0, len(ms)) // the measurement of each request
	for i, m := range ms {
		user, ten, err := r.candidates(s, m.o.tenant)
		if err != nil {
			return nil, err
		}
		rules := user
		if m.o.user == "" {
			rules = ten
		}
		if len(rules) > 0 {
			reqs = append(reqs, repair.WindowsRequest{Tenant: m.o.tenant, User: m.keyUser, Rules: rules})
			read = append(read, i)
		}
	}
	out := make([][]drift, len(ms))
	for k, res := range r.rep.WindowsMany(ctx, reqs) {
		if res.Err != nil {
			return nil, res.Err
		}
		m := &ms[read[k]]
		out[read[k]] = driftsOf(m.o, m.t, res.Windows)
	}
	return out, nil
}

// driftsOf returns each window of ws, o's, that differs from tally t outside
// its oldest bucket.
//
// A window holds at most limits.MaxCost, where the scripts saturate it (the
// cap of every count in the events). So where the ledger puts the cap or
// more in a window, Redis agrees once the window is full; short of that,
// the one fix is what fills it, in the newest bucket Redis holds less of
// than the ledger. Comparing bucket by bucket instead would find a drift
// that no repair can remove, and ask for repairs past what Charge accepts.
func driftsOf(o owner, t tally, ws []repair.Window) []drift {
	var out []drift
	for i := range ws {
		bs := ws[i].Buckets
		if ws[i].Rule.Kind == policy.Rolling {
			bs = bs[1:]
		}
		id := idOf(ws[i].Rule)
		x := drift{key: driftKey{o, id}, rule: *ws[i].Rule}
		var want int64
		for _, b := range ws[i].Buckets {
			want += t[bucket{id, b.N}]
		}
		if want >= limits.MaxCost {
			x.fix = fill(id, t, bs, limits.MaxCost-ws[i].Used())
		} else {
			for _, b := range bs {
				if diff := t[bucket{id, b.N}] - b.Used; diff != 0 {
					x.fix = append(x.fix, fix{b.N, diff})
				}
			}
		}
		for _, f := range x.fix {
			x.net += f.tokens
		}
		if x.net != 0 {
			out = append(out, x)
		}
	}
	return out
}

// fill is the fix that adds room tokens to a saturated window: in the newest
// of buckets bs that holds less than tally t says. None when the window is
// full, or only its oldest bucket (not compared) holds less.
func fill(id limitID, t tally, bs []repair.Bucket, room int64) []fix {
	if room <= 0 {
		return nil
	}
	for k := len(bs) - 1; k >= 0; k-- {
		if t[bucket{id, bs[k].N}] > bs[k].Used {
			return []fix{{bs[k].N, room}}
		}
	}
	return nil
}

// repairStable repairs the drifts of found that the previous scan saw
// exactly so, owner by owner, each after a quiet fresh measurement.
func (r *Reconciler) repairStable(ctx context.Context, s *scan, found []drift, prev map[driftKey]string, d *Drift) error {
	stable := map[owner]map[limitID]string{}
	var order []owner
	for i := range found {
		x := &found[i]
		fp := x.fingerprint()
		if prev[x.key] != fp {
			continue
		}
		if stable[x.key.owner] == nil {
			stable[x.key.owner] = map[limitID]string{}
			order = append(order, x.key.owner)
		}
		stable[x.key.owner][x.key.limitID] = fp
	}
	if len(order) == 0 {
		return nil
	}
	// The gate before the lock's connection, as the consumers do: no
	// rebuild of Redis meanwhile, and none kept waiting for a connection.
	return r.gate.Hold(func() error { return r.repairLocked(ctx, s, order, stable, d) })
}

// repairLocked takes the repair lock and repairs, owner by owner in order,
// the stable drifts a fresh measurement finds again while the consumer is
// quiet.
func (r *Reconciler) repairLocked(ctx context.Context, s *scan, order []owner, stable map[owner]map[limitID]string, d *Drift) error {
	unlock, ok, err := r.store.TryLock(ctx, reconcileLockID)
	if err != nil || !ok {
		return err // another instance is repairing: the next scan rechecks
	}
	defer unlock()
	for _, o := range order {
		fresh, quiet, err := r.remeasure(ctx, s, o)
		if err != nil {
			return err
		}
		if !quiet {
			d.Held += len(stable[o])
			continue
		}
		for i := range fresh {
			x := &fresh[i]
			if fp, ok := stable[o][x.key.limitID]; !ok || fp != x.fingerprint() {
				continue
			}
			if err := r.apply(ctx, o, x, d); err != nil {
				return err
			}
			delete(r.seen, x.key) // a drift after the repair must be seen twice again
		}
	}
	return nil
}

// remeasure measures o again from a fresh read of the ledger and Redis,
// and says whether the consumer was quiet throughout: nothing pending
// before, nothing delivered since.
func (r *Reconciler) remeasure(ctx context.Context, s *scan, o owner) ([]drift, bool, error) {
	pending, delivered, err := r.backlog.Backlog(ctx)
	if err != nil || pending > 0 {
		return nil, false, err
	}
	t, keyUser := tally{}, o.user
	err = r.store.UsageOf(ctx, s.since, o.tenant, o.user, func(u ledger.Usage) error {
		keyUser = u.User
		if o.user == "" {
			return r.count(s, u, tally{}, t)
		}
		return r.count(s, u, t, tally{})
	})
	if err != nil {
		return nil, false, err
	}
	if keyUser == "" {
		keyUser = "-" // a tenant with no usage: any name addresses its blob
	}
	dss, err := r.compare(ctx, s, []measurement{{o, keyUser, t}})
	if err != nil {
		return nil, false, err
	}
	pending2, delivered2, err := r.backlog.Backlog(ctx)
	if err != nil {
		return nil, false, err
	}
	return dss[0], pending2 == 0 && delivered2 == delivered, nil
}

// apply charges each bucket's difference of drift x at the bucket's time.
func (r *Reconciler) apply(ctx context.Context, o owner, x *drift, d *Drift) error {
	user := o.user
	if user == "" {
		user = "-" // tenant-wide limits live in the tenant's blob
	}
	var raised, lowered int64
	for _, f := range x.fix {
		_, err := r.rep.Charge(ctx, repair.ChargeRequest{
			Tenant: o.tenant, User: user, Rules: []policy.Rule{x.rule},
			Amount: f.tokens, At: repair.BucketStart(&x.rule, f.n),
		})
		if err != nil {
			return fmt.Errorf("repair %s/%s %s: %w", o.tenant, o.user, x.rule.Name, err)
		}
		if f.tokens > 0 {
			raised += f.tokens
		} else {
			lowered -= f.tokens
		}
	}
	d.Repaired++
	d.Raised += raised
	d.Lowered += lowered
	r.log.Warn("repaired redis window from the ledger",
		"tenant", o.tenant, "user", o.user, "scope", string(x.rule.Scope), "limit", x.rule.Name,
		"endpoint", x.rule.Endpoint, "raised", raised, "lowered", lowered)
	return nil
}
