package detect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/store"
)

// Options tune detection. The zero value of a field means its default.
type Options struct {
	// Hysteresis is how far, in percentage points, usage must fall under a
	// fired threshold before it re-arms.
	Hysteresis float64
	// SpikeWindow is the span of the denial rate.
	SpikeWindow time.Duration
	// SpikeRate is the denial rate (0-1) above which a spike fires.
	SpikeRate float64
	// SpikeMinRequests is the fewest requests in the window for a spike to
	// fire.
	SpikeMinRequests int64
	// AbuseWindow is the span of an abuse burst.
	AbuseWindow time.Duration
	// AbuseBurst is how many denials of one subject or IP within
	// AbuseWindow raise quota.abuse_suspected.
	AbuseBurst int64
	// TopTenants is how many tenants the top-tenant gauges show.
	TopTenants int
}

// Defaults of Options: a spike is a denial rate above 5 % over 5 minutes
// with at least 100 requests; abuse is 50 denials within a minute.
const (
	DefaultHysteresis       = 5
	DefaultSpikeWindow      = 5 * time.Minute
	DefaultSpikeRate        = 0.05
	DefaultSpikeMinRequests = 100
	DefaultAbuseWindow      = time.Minute
	DefaultAbuseBurst       = 50
)

func (o Options) withDefaults() Options {
	if o.Hysteresis == 0 {
		o.Hysteresis = DefaultHysteresis
	}
	if o.SpikeWindow == 0 {
		o.SpikeWindow = DefaultSpikeWindow
	}
	if o.SpikeRate == 0 {
		o.SpikeRate = DefaultSpikeRate
	}
	if o.SpikeMinRequests == 0 {
		o.SpikeMinRequests = DefaultSpikeMinRequests
	}
	if o.AbuseWindow == 0 {
		o.AbuseWindow = DefaultAbuseWindow
	}
	if o.AbuseBurst == 0 {
		o.AbuseBurst = DefaultAbuseBurst
	}
	if o.TopTenants == 0 {
		o.TopTenants = DefaultTopTenants
	}
	return o
}

// Updater is the detector's durable state (store.Store): transactions,
// versions moved on their own, and what Load reads.
type Updater interface {
	Update(ctx context.Context, fn func(tx *store.Tx) error) error
	SaveVersions(ctx context.Context, versions map[store.VersionKey]int64) error
	FiringSpikes(ctx context.Context) ([][2]string, error)
	RaisedLimits(ctx context.Context, max int) (map[store.LimitKey]int, bool, error)
	ReArmUndefined(ctx context.Context, defined store.Defined) ([]store.LimitKey, error)
	Abusing(ctx context.Context) ([]store.AbuseKey, error)
	EndAbuse(ctx context.Context, k store.AbuseKey) error
}

// maxRaised bounds the limits the detector keeps in memory as raised
// (about 150 bytes each); past it, it stops trusting an absent limit to be
// at level 0 and reads the state of every snapshot's limits until it
// restarts (correct, but a read per batch).
const maxRaised = 200_000

// Router names the webhooks that want an alert of kind for tenant;
// threshold is the percentage a quota.threshold alert crossed, 0 for
// other kinds.
type Router func(kind, tenant string, threshold int) []string

// Detector raises alerts from events. Its event methods fit
// stream.Handlers; Run evaluates the rate-based alerts periodically. It is
// safe for concurrent use. Create it with New.
//
// Run one alerter per consumer and database: the rate windows and the
// set of raised limits are per process. (Several instances on one
// durable would each see part of the traffic.) Threshold state itself is
// in Postgres, and only the state of a limit that fired is stored: a
// limit at level 0 reads as absent. The detector keeps every limit whose
// level is above 0 in memory (loaded by Load, kept by its own commits), so
// a snapshot whose limits are all absent from it and under the lowest
// threshold can neither fire nor re-arm anything and reads and writes no
// state (quiet). HandleBatch handles a whole batch of events in one
// transaction, or, when every snapshot of it is quiet, holds their
// versions in memory until Flush, or the next transaction, writes them:
// a consumer acks a message only after a Flush that followed its
// handling, so a version is durable before its message is done with,
// and the two snapshots of a request (reserved, then corrected) mostly
// share one row write.
type Detector struct {
	st     Updater
	route  Router
	opt    Options
	log    *slog.Logger
	now    func() time.Time
	alerts *prometheus.CounterVec
	notify func() // told after alerts were queued
	top    *topTenants
	// policy holds the thresholds of the policy in force (SetPolicy); nil
	// until one is set: every limit then alerts at legacyThresholds.
	policy atomic.Pointer[alertPolicy]

	mu sync.Mutex
	// raised holds the committed level of every limit above level 0,
	// unless raisedAll is false (past maxRaised); unknown the limits whose
	// level a failed transaction left in doubt, read again before use.
	raised    map[store.LimitKey]int
	raisedAll bool
	unknown   map[store.LimitKey]bool
	started   time.Time
	spikes    map[[2]string]*window // (tenant, endpoint) -> (allowed, denied)
	firing    map[[2]string]bool    // spikes firing, as last stored
	abuse     map[abuseKey]*window  // -> (denied, 0)
	abusing   map[abuseKey]bool     // bursts alerted and not yet over, as stored
	seen      seen                  // events counted in the windows
	// held is the highest version of each subject that quiet snapshots
	// moved and no commit has written yet (Flush writes them).
	held map[store.VersionKey]int64
}

type abuseKey struct{ tenant, user, ip string }

func (k abuseKey) stored() store.AbuseKey {
	return store.AbuseKey{Tenant: k.tenant, User: k.user, IP: k.ip}
}

// New returns a Detector storing state in st, routing alerts with route
// and counting them in quotaflow_alerts_total{kind} on reg. notify, when
// not nil, is called after alerts were queued (to wake the deliverer).
func New(st Updater, route Router, opt Options, log *slog.Logger, reg prometheus.Registerer, notify func()) (*Detector, error) {
	d := &Detector{
		st: st, route: route, opt: opt.withDefaults(), log: log.With("component", "detect"),
		now: time.Now, notify: notify,
		spikes: map[[2]string]*window{}, firing: map[[2]string]bool{},
		abuse: map[abuseKey]*window{}, abusing: map[abuseKey]bool{},
		raised: map[store.LimitKey]int{}, unknown: map[store.LimitKey]bool{}, seen: newSeen(),
		held: map[store.VersionKey]int64{},
	}
	d.alerts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_alerts_total",
		Help: "Alerts raised, by kind.",
	}, []string{"kind"})
	for _, k := range Kinds {
		d.alerts.WithLabelValues(k)
	}
	if err := reg.Register(d.alerts); err != nil {
		return nil, fmt.Errorf("register alert metrics: %w", err)
	}
	var err error
	if d.top, err = newTopTenants(d.opt.TopTenants, reg); err != nil {
		return nil, err
	}
	d.started = d.now()
	return d, nil
}

// Load reads the spikes that were firing when the alerter last stopped,
// so their resolution is still sent, the denial bursts alerted and not
// over, so they are not alerted again, and the limits raised. Until it
// ran, every snapshot reads its limits' state.
func (d *Detector) Load(ctx context.Context) error {
	keys, err := d.st.FiringSpikes(ctx)
	if err != nil {
		return err
	}
	bursts, err := d.st.Abusing(ctx)
	if err != nil {
		return err
	}
	raised, all, err := d.st.RaisedLimits(ctx, maxRaised)
	if err != nil {
		return err
	}
	if !all {
		d.log.Warn("more limits raised than kept in memory: every snapshot reads its limits' state", "max", maxRaised)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, k := range keys {
		d.firing[k] = true
	}
	for _, k := range bursts {
		d.abusing[abuseKey{k.Tenant, k.User, k.IP}] = true
	}
	d.raised, d.raisedAll = raised, all
	if d.raised == nil {
		d.raised = map[store.LimitKey]int{}
	}
	return nil
}

// Reserved handles a reserved event, as a batch of one: one allowed
// request for the rate alerts, and its limits snapshot for the thresholds
// unless admission decided it without Redis.
func (d *Detector) Reserved(ctx context.Context, ev events.Event, r events.Reserved) error {
	ev.Data = r
	return d.HandleBatch(ctx, []events.Event{ev})
}

// decidedLocally reports whether admission decided r without Redis
// (version 0, see events.Reserved). Its limits are that instance's local
// view, not usage in Redis: for a subject it never saw they would claim a
// nearly full quota. They are no snapshot to cross thresholds with, and,
// having no version, none to order by either.
func decidedLocally(r events.Reserved) bool { return r.Version == 0 }

// Corrected handles a corrected event's limits snapshot, as a batch of
// one.
func (d *Detector) Corrected(ctx context.Context, ev events.Event, c events.Corrected) error {
	ev.Data = c
	return d.HandleBatch(ctx, []events.Event{ev})
}

// Denied counts a denied event's denials for the rate alerts.
func (d *Detector) Denied(_ context.Context, ev events.Event, n events.Denied) error {
	d.count(ev, n.Tenant, n.Endpoint, 0, n.Count, func(at time.Time) {
		for _, k := range []abuseKey{{tenant: n.Tenant, user: n.User}, {ip: n.IP}} {
			if k == (abuseKey{}) {
				continue // no IP
			}
			w := d.abuse[k]
			if w == nil {
				w = &window{}
				d.abuse[k] = w
			}
			w.add(at, n.Count, 0)
		}
	})
	return nil
}

// clamp returns at, or now when at is in the future; zero when at is
// older than every window (nothing to count).
func (d *Detector) clamp(at time.Time) time.Time {
	now := d.now()
	if at.After(now) {
		return now
	}
	if now.Sub(at) > d.longestWindow() {
		return time.Time{}
	}
	return at
}

func (d *Detector) longestWindow() time.Duration { return max(d.opt.SpikeWindow, d.opt.AbuseWindow) }

// count adds ev's allowed and denied requests to the spike windows of
// tenant and endpoint, and calls also (under mu) with the time counted,
// unless ev is too old to count or was counted before (seen: an event may
// be stored in two messages). It clamps under mu, so that no Evaluate
// prunes seen between the clamp and the check: seen holds every id that
// clamp would still count.
func (d *Detector) count(ev events.Event, tenant, endpoint string, allowed, denied int64, also func(at time.Time)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	at := d.clamp(ev.Time)
	if at.IsZero() {
		return
	}
	if !d.seen.first(ev.ID, ev.Time) {
		return
	}
	for _, k := range [][2]string{{tenant, ""}, {"", endpoint}} {
		w := d.spikes[k]
		if w == nil {
			w = &window{}
			d.spikes[k] = w
		}
		w.add(at, allowed, denied)
	}
	if also != nil {
		also(at)
	}
}

// committed brings the raised limits in line with the transaction that
// read touched and left them at levels: merged when it committed, when the fired alerts are counted;
// when it failed, the levels of touched are in doubt (a commit may fail
// after Postgres applied it) until a transaction reads them again. It
// returns err.
func (d *Detector) committed(err error, touched map[store.LimitKey]bool, levels map[store.LimitKey]int, fired int) error {
	d.mu.Lock()
	if err != nil {
		for k := range touched {
			d.unknown[k] = true
		}
		d.mu.Unlock()
		return err
	}
	for k, lvl := range levels {
		delete(d.unknown, k)
		switch {
		case !d.raisedAll: // not kept
		case lvl > 0:
			d.raised[k] = lvl
		default:
			delete(d.raised, k)
		}
	}
	if d.raisedAll && len(d.raised) > maxRaised {
		d.raisedAll = false
		clear(d.raised)
		d.log.Warn("more limits raised than kept in memory: every snapshot reads its limits' state", "max", maxRaised)
	}
	d.mu.Unlock()
	d.alerted(KindThreshold, fired)
	return nil
}

// hold keeps versions (the highest of each subject) for Flush.
func (d *Detector) hold(versions map[store.VersionKey]int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, v := range versions {
		if v > d.held[k] {
			d.held[k] = v
		}
	}
}

// heldVersions returns a copy of the versions held.
func (d *Detector) heldVersions() map[store.VersionKey]int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.held)
}

// written forgets the held versions that a commit of versions wrote (or
// passed).
func (d *Detector) written(versions map[store.VersionKey]int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, v := range versions {
		if d.held[k] <= v {
			delete(d.held, k)
		}
	}
}

// Flush writes the versions that quiet snapshots moved since the last
// commit, in one statement. A consumer calls it before it acks the
// messages it handled: until then a crash loses those versions together
// with the acks, so the messages come again.
func (d *Detector) Flush(ctx context.Context) error {
	versions := d.heldVersions()
	if len(versions) == 0 {
		return nil
	}
	if err := d.st.SaveVersions(ctx, versions); err != nil {
		return err
	}
	d.written(versions)
	return nil
}

// SetPolicy makes p's alert thresholds and kinds those of the limits of
// the snapshots handled from now on (docs/design.md §7: each limit's
// alerts, or its kind's default; its kind says what its reset time
// means). Call it with each policy that comes in force. Threshold state
// needs no migration: a limit's level is a percentage, which step reads
// under any list of thresholds; and a limit whose kind changed counts
// afresh in Redis (policy.Rule.ID hashes the kind), so its first
// snapshots under the new kind re-arm it by hysteresis.
func (d *Detector) SetPolicy(p *policy.Policy) {
	d.policy.Store(newAlertPolicy(p))
}

// rule returns the rule of limit l in a snapshot of tenant's decided under
// plan ("" when unknown), by the policy in force.
func (d *Detector) rule(tenant, plan string, l events.LimitState) limitRule {
	return d.policy.Load().rule(tenant, plan, l.Scope, l.Endpoint, l.Name)
}

// Prune re-arms the raised limits that p does not define (ReArmUndefined)
// and forgets them: a policy reload removed them, so no snapshot would
// ever lower them, and without it the raised set grows with every reload
// that renames or drops limits until it passes maxRaised and every
// snapshot reads its state. A limit counts as defined when any plan has
// one of its name (a request may name its plan), when its endpoint's user
// list has it, and, tenant-wide, when its tenant's entry has it. Call it
// with each policy that comes in force, the first one included. It
// returns how many raised limits it re-armed.
func (d *Detector) Prune(ctx context.Context, p *policy.Policy) (int, error) {
	defined := newAlertPolicy(p).defined()
	// Under mu across the update: a commit that raises one of these limits
	// meanwhile then raises it in memory after the update forgot it, so the
	// memory never holds less than Postgres (the snapshot after reads it).
	d.mu.Lock()
	defer d.mu.Unlock()
	d.top.forget(func(tenant, name string) bool {
		return defined.Has(store.LimitKey{Tenant: tenant, Scope: "tenant", Name: name})
	})
	keys, err := d.st.ReArmUndefined(ctx, defined)
	if err != nil {
		return 0, err
	}
	for _, k := range keys {
		delete(d.raised, k)
	}
	for k := range d.unknown {
		if !defined.Has(k) { // now at level 0 in Postgres, whatever the failed commit did
			delete(d.unknown, k)
		}
	}
	if len(keys) > 0 {
		d.log.Info("limits no longer in the policy re-armed", "limits", len(keys), "policy_digest", p.Digest())
	}
	return len(keys), nil
}

// quiet reports whether a snapshot leaves every threshold state as it is:
// each user- and tenant-scope limit is known to be at level 0 (not
// raised) and is under its lowest threshold (or has none), so it can
// neither fire nor re-arm anything. (At level 0 a state's last usage and
// reset time are never read, so they need no update.)
func (d *Detector) quiet(s snap) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.raisedAll {
		return false
	}
	for _, l := range s.limits {
		k, ok := limitKey(s.tenant, s.user, l)
		if !ok {
			continue
		}
		if d.raised[k] != 0 || d.unknown[k] {
			return false
		}
		if ts := d.rule(s.tenant, s.plan, l).thresholds; len(ts) > 0 && percent(l.Used, l.Limit) >= float64(ts[0]) {
			return false
		}
	}
	return true
}

// enqueue queues alert a, its payload the body of data, for the webhooks
// that want it (threshold: the percentage crossed, 0 but for thresholds).
func (d *Detector) enqueue(ctx context.Context, tx *store.Tx, a store.Alert, threshold int, now time.Time, data any) error {
	b, err := body(a.Kind, now, data)
	if err != nil {
		return fmt.Errorf("encode %s alert: %w", a.Kind, err)
	}
	a.Payload = b
	return tx.Enqueue(ctx, a, d.route(a.Kind, a.Tenant, threshold))
}

// thresholdAlert is the alert of threshold t of limit k at its fire-th
// firing: its id is new at each firing, and every alert of the limit is
// delivered in order (docs/design.md §7: a jump from 70 to 100 % sends 80, 90 and
// 100 in this order).
func thresholdAlert(k store.LimitKey, t int, fire int64) store.Alert {
	return store.Alert{
		ID: events.HashID(KindThreshold, k.Tenant, k.User, k.Scope, k.Endpoint, k.Name,
			strconv.Itoa(t), strconv.FormatInt(fire, 10)),
		Kind: KindThreshold, Tenant: k.Tenant,
		Order: events.HashID(KindThreshold, k.Tenant, k.User, k.Scope, k.Endpoint, k.Name),
	}
}

func (d *Detector) alerted(kind string, n int) {
	if n == 0 {
		return
	}
	d.alerts.WithLabelValues(kind).Add(float64(n))
	if d.notify != nil {
		d.notify()
	}
}

// Run calls Evaluate every interval until ctx ends, logging its errors.
func (d *Detector) Run(ctx context.Context, interval time.Duration) {
	service.Every(ctx, interval, func(ctx context.Context) {
		if err := d.Evaluate(ctx); err != nil && ctx.Err() == nil {
			d.log.Error("evaluate rate alerts", "err", err)
		}
	})
}

type spikeChange struct {
	key             [2]string
	allowed, denied int64
	firing          bool
}

// Evaluate checks the denial rates and denial bursts at the current time
// and raises the spike (firing or resolved) and abuse alerts due, and
// publishes the top tenants' gauges. A spike
// fires when the window holds at least SpikeMinRequests requests and the
// denial rate exceeds SpikeRate; it resolves when the rate is back at or
// under SpikeRate with enough requests, or when fewer requests than that
// came in a whole window. A burst alerts once: it is over when its window
// holds fewer than AbuseBurst denials, judged only once this process has
// counted for a whole AbuseWindow (a burst alerted before a restart is
// not over because the new process's counts start empty).
func (d *Detector) Evaluate(ctx context.Context) error {
	now := d.now()
	d.top.publish(now)
	var changes []spikeChange
	type burst struct {
		k abuseKey
		n int64
	}
	var bursts []burst
	d.mu.Lock()
	fullWindow := now.Sub(d.started) >= d.opt.SpikeWindow
	keys := make(map[[2]string]bool, len(d.spikes)+len(d.firing))
	for k := range d.spikes {
		keys[k] = true
	}
	for k := range d.firing {
		keys[k] = true
	}
	for k := range keys {
		var allowed, denied int64
		if w := d.spikes[k]; w != nil {
			allowed, denied = w.sum(now, d.opt.SpikeWindow)
			if w.empty() {
				delete(d.spikes, k)
			}
		}
		total := allowed + denied
		enough := total >= d.opt.SpikeMinRequests
		high := enough && float64(denied) > d.opt.SpikeRate*float64(total)
		switch {
		case !d.firing[k] && high:
			changes = append(changes, spikeChange{k, allowed, denied, true})
		case d.firing[k] && !high && (enough || fullWindow):
			changes = append(changes, spikeChange{k, allowed, denied, false})
		}
	}
	denials := make(map[abuseKey]int64, len(d.abuse))
	for k, w := range d.abuse {
		n, _ := w.sum(now, d.opt.AbuseWindow)
		if w.empty() {
			delete(d.abuse, k)
		}
		denials[k] = n
		if n >= d.opt.AbuseBurst && !d.abusing[k] {
			bursts = append(bursts, burst{k, n})
		}
	}
	var over []abuseKey // bursts over: a new one alerts again
	if now.Sub(d.started) >= d.opt.AbuseWindow {
		for k := range d.abusing {
			if denials[k] < d.opt.AbuseBurst {
				over = append(over, k)
			}
		}
	}
	d.seen.prune(now.Add(-d.longestWindow() - time.Second))
	d.mu.Unlock()

	var errs []error
	for _, c := range changes {
		if err := d.spike(ctx, now, c); err != nil {
			errs = append(errs, err)
		}
	}
	for _, b := range bursts {
		if err := d.burst(ctx, now, b.k, b.n); err != nil {
			errs = append(errs, err)
		}
	}
	for _, k := range over {
		if err := d.st.EndAbuse(ctx, k.stored()); err != nil {
			errs = append(errs, err) // still abusing: ended at the next evaluation
			continue
		}
		d.mu.Lock()
		delete(d.abusing, k)
		d.mu.Unlock()
	}
	return errors.Join(errs...)
}

func (d *Detector) spike(ctx context.Context, now time.Time, c spikeChange) error {
	tenant, endpoint := c.key[0], c.key[1]
	sent := false
	err := d.st.Update(ctx, func(tx *store.Tx) error {
		sent = false
		firing, episode, err := tx.Spike(ctx, tenant, endpoint)
		if err != nil {
			return err
		}
		if firing == c.firing {
			return nil // another instance got there first
		}
		state := StateResolved
		if c.firing {
			state = StateFiring
			episode++
		}
		if err := tx.SaveSpike(ctx, tenant, endpoint, c.firing, episode); err != nil {
			return err
		}
		total := c.allowed + c.denied
		rate := 0.0
		if total > 0 {
			rate = float64(c.denied) / float64(total)
		}
		data := SpikeData{
			Tenant: tenant, Endpoint: endpoint, DenialRate: rate, Denied: c.denied, Total: total,
			WindowSeconds: int64(d.opt.SpikeWindow / time.Second), State: state,
		}
		// A spike's resolution goes out after its firing.
		a := store.Alert{
			ID:   events.HashID(KindSpike, tenant, endpoint, strconv.FormatInt(episode, 10), state),
			Kind: KindSpike, Tenant: tenant, Order: events.HashID(KindSpike, tenant, endpoint),
		}
		sent = true
		return d.enqueue(ctx, tx, a, 0, now, data)
	})
	if err != nil {
		return fmt.Errorf("denial spike %q %q: %w", tenant, endpoint, err)
	}
	d.mu.Lock()
	d.firing[c.key] = c.firing
	if !c.firing {
		delete(d.firing, c.key)
	}
	d.mu.Unlock()
	if sent {
		d.alerted(KindSpike, 1)
	}
	return nil
}

func (d *Detector) burst(ctx context.Context, now time.Time, k abuseKey, n int64) error {
	key := "subject"
	if k.ip != "" {
		key = "ip"
	}
	data := AbuseData{
		Key: key, Tenant: k.tenant, User: k.user, IP: k.ip, Denied: n,
		WindowSeconds: int64(d.opt.AbuseWindow / time.Second), OccurredAt: now.UTC(),
	}
	// The id is unique per burst: its key and the second it was detected.
	// Bursts are separate alerts with no order to keep.
	a := store.Alert{
		ID:   events.HashID(KindAbuse, key, k.tenant, k.user, k.ip, strconv.FormatInt(now.Unix(), 10)),
		Kind: KindAbuse, Tenant: k.tenant,
	}
	var fresh bool
	err := d.st.Update(ctx, func(tx *store.Tx) (err error) {
		fresh, err = tx.SaveAbuse(ctx, k.stored())
		if err != nil || !fresh {
			return err
		}
		return d.enqueue(ctx, tx, a, 0, now, data)
	})
	if err != nil {
		return fmt.Errorf("abuse alert: %w", err)
	}
	d.mu.Lock()
	d.abusing[k] = true
	d.mu.Unlock()
	if fresh {
		d.alerted(KindAbuse, 1)
	}
	return nil
}
