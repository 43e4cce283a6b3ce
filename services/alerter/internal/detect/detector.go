package detect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
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
	return o
}

// Updater runs a function in one Postgres transaction (store.Store).
type Updater interface {
	Update(ctx context.Context, fn func(tx *store.Tx) error) error
	AdvanceVersions(ctx context.Context, tenant, user string, version, tenantVersion int64) error
	FiringSpikes(ctx context.Context) ([][2]string, error)
}

// maxCachedLevels bounds the level cache; past it the cache starts over
// (a miss only costs a transaction).
const maxCachedLevels = 200_000

// Router names the webhooks that want an alert of kind for tenant.
type Router func(kind, tenant string) []string

// Detector raises alerts from events. Its event methods fit
// stream.Handlers; Run evaluates the rate-based alerts periodically. It is
// safe for concurrent use. Create it with New.
//
// Run one alerter per consumer: the rate windows and the cache of
// threshold levels are per process. (Several instances on one durable
// would each see part of the traffic.) Threshold state itself is in
// Postgres; a snapshot that can change it costs one transaction, one that
// cannot (every limit known to be armed and under 75%) one statement.
// HandleBatch handles a whole batch of events in one transaction, which
// is how the alerter consumes.
type Detector struct {
	st     Updater
	route  Router
	opt    Options
	log    *slog.Logger
	now    func() time.Time
	alerts *prometheus.CounterVec
	notify func() // told after alerts were queued

	mu      sync.Mutex
	levels  map[store.LimitKey]int // committed threshold levels, a cache
	started time.Time
	spikes  map[[2]string]*window // (tenant, endpoint) -> (allowed, denied)
	firing  map[[2]string]bool    // spikes firing, as last stored
	abuse   map[abuseKey]*window  // -> (denied, 0)
	abusing map[abuseKey]bool     // bursts alerted and not yet over
	seen    seen                  // events counted in the windows
}

type abuseKey struct{ tenant, user, ip string }

// New returns a Detector storing state in st, routing alerts with route
// and counting them in quotaflow_alerts_total{kind} on reg. notify, when
// not nil, is called after alerts were queued (to wake the deliverer).
func New(st Updater, route Router, opt Options, log *slog.Logger, reg prometheus.Registerer, notify func()) (*Detector, error) {
	d := &Detector{
		st: st, route: route, opt: opt.withDefaults(), log: log.With("component", "detect"),
		now: time.Now, notify: notify,
		spikes: map[[2]string]*window{}, firing: map[[2]string]bool{},
		abuse: map[abuseKey]*window{}, abusing: map[abuseKey]bool{},
		levels: map[store.LimitKey]int{}, seen: newSeen(),
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
	d.started = d.now()
	return d, nil
}

// Load reads the spikes that were firing when the alerter last stopped,
// so their resolution is still sent.
func (d *Detector) Load(ctx context.Context) error {
	keys, err := d.st.FiringSpikes(ctx)
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, k := range keys {
		d.firing[k] = true
	}
	return nil
}

// Reserved handles a reserved event: one allowed request for the rate
// alerts, and its limits snapshot for the thresholds unless admission
// decided it without Redis.
func (d *Detector) Reserved(ctx context.Context, ev events.Event, r events.Reserved) error {
	d.count(ev, r.Tenant, r.Endpoint, 1, 0, nil)
	if decidedLocally(r) {
		return nil
	}
	return d.snapshot(ctx, ev, r.Tenant, r.User, r.Version, r.TenantVersion, r.Limits)
}

// decidedLocally reports whether admission decided r without Redis
// (version 0, see events.Reserved). Its limits are that instance's local
// view, not usage in Redis: for a subject it never saw they would claim a
// nearly full quota. They are no snapshot to cross thresholds with, and,
// having no version, none to order by either.
func decidedLocally(r events.Reserved) bool { return r.Version == 0 }

// Corrected handles a corrected event's limits snapshot.
func (d *Detector) Corrected(ctx context.Context, ev events.Event, c events.Corrected) error {
	return d.snapshot(ctx, ev, c.Tenant, c.User, c.Version, c.TenantVersion, c.Limits)
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
// be stored in two messages).
func (d *Detector) count(ev events.Event, tenant, endpoint string, allowed, denied int64, also func(at time.Time)) {
	at := d.clamp(ev.Time)
	if at.IsZero() {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
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

// snapshot applies a limits snapshot in one transaction: it drops it when
// stale, moves each user- and tenant-scope limit's threshold state and
// queues the alerts of the thresholds crossed.
func (d *Detector) snapshot(ctx context.Context, ev events.Event, tenant, user string, version, tenantVersion int64, limits []events.LimitState) error {
	if len(limits) == 0 {
		return nil
	}
	if d.quiet(tenant, user, limits) {
		// Nothing can fire or re-arm: only the versions move.
		return d.st.AdvanceVersions(ctx, tenant, user, version, tenantVersion)
	}
	now := d.now()
	fired := 0
	var levels map[store.LimitKey]int
	err := d.st.Update(ctx, func(tx *store.Tx) error {
		fired = 0
		levels = map[store.LimitKey]int{}
		userFresh, err := tx.Advance(ctx, tenant, user, "user", version)
		if err != nil {
			return err
		}
		tenantFresh := true // unordered when the tenant's version is unknown
		if tenantVersion > 0 {
			if tenantFresh, err = tx.Advance(ctx, tenant, "", "tenant", tenantVersion); err != nil {
				return err
			}
		}
		for _, l := range limits {
			k := store.LimitKey{Tenant: tenant, Scope: l.Scope, Endpoint: l.Endpoint, Name: l.Name}
			switch {
			case l.Scope == "user" && userFresh:
				k.User = user
			case l.Scope == "tenant" && tenantFresh:
			default:
				continue // stale, or a global or IP limit: not a tenant's quota
			}
			st, err := tx.Limit(ctx, k)
			if err != nil {
				return err
			}
			var resetAt time.Time
			if l.ResetSeconds > 0 {
				resetAt = ev.Time.Add(time.Duration(l.ResetSeconds) * time.Second)
			}
			prev := st.Fires
			st, crossed := step(st, l.Used, l.Limit, ev.Time, resetAt, d.opt.Hysteresis)
			if err := tx.SaveLimit(ctx, k, st); err != nil {
				return err
			}
			levels[k] = st.Level
			for i, t := range crossed {
				data := ThresholdData{
					Tenant: tenant, User: k.User, Scope: l.Scope, Endpoint: l.Endpoint, LimitName: l.Name,
					Unit: l.Unit, Threshold: t, Used: l.Used, Limit: l.Limit,
					Percent: min(percent(l.Used, l.Limit), 100), ResetSeconds: l.ResetSeconds, OccurredAt: ev.Time,
				}
				if err := d.enqueue(ctx, tx, thresholdAlert(k, t, prev+int64(i)+1), now, data); err != nil {
					return err
				}
				fired++
			}
		}
		return nil
	})
	if err != nil {
		err = fmt.Errorf("thresholds of %s/%s: %w", tenant, user, err)
	}
	return d.committed(err, levels, fired)
}

// committed brings the cache of threshold levels in line with the
// transaction that computed levels: dropped when it failed (the cache may
// not match what was rolled back), merged when it committed, when the fired
// alerts are counted. It returns err.
func (d *Detector) committed(err error, levels map[store.LimitKey]int, fired int) error {
	d.mu.Lock()
	if err != nil {
		clear(d.levels)
		d.mu.Unlock()
		return err
	}
	if len(d.levels)+len(levels) > maxCachedLevels {
		clear(d.levels)
	}
	maps.Copy(d.levels, levels)
	d.mu.Unlock()
	d.raised(KindThreshold, fired)
	return nil
}

// quiet reports whether a snapshot leaves every threshold state as it is:
// each user- and tenant-scope limit is known to have nothing fired and is
// under the lowest threshold's re-arm band, so it can neither fire nor
// re-arm anything. The level cache is this instance's: it assumes one
// alerter works on the consumer (as the rate alerts do).
func (d *Detector) quiet(tenant, user string, limits []events.LimitState) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, l := range limits {
		k := store.LimitKey{Tenant: tenant, Scope: l.Scope, Endpoint: l.Endpoint, Name: l.Name}
		switch l.Scope {
		case "user":
			k.User = user
		case "tenant":
		default:
			continue
		}
		if lvl, ok := d.levels[k]; !ok || lvl != 0 || percent(l.Used, l.Limit) >= float64(Thresholds[0])-d.opt.Hysteresis {
			return false
		}
	}
	return true
}

// enqueue queues alert a, its payload the body of data, for the webhooks
// that want it.
func (d *Detector) enqueue(ctx context.Context, tx *store.Tx, a store.Alert, now time.Time, data any) error {
	b, err := body(a.Kind, now, data)
	if err != nil {
		return fmt.Errorf("encode %s alert: %w", a.Kind, err)
	}
	a.Payload = b
	return tx.Enqueue(ctx, a, d.route(a.Kind, a.Tenant))
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

func (d *Detector) raised(kind string, n int) {
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
// and raises the spike (firing or resolved) and abuse alerts due. A spike
// fires when the window holds at least SpikeMinRequests requests and the
// denial rate exceeds SpikeRate; it resolves when the rate is back at or
// under SpikeRate with enough requests, or when fewer requests than that
// came in a whole window.
func (d *Detector) Evaluate(ctx context.Context) error {
	now := d.now()
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
	for k, w := range d.abuse {
		n, _ := w.sum(now, d.opt.AbuseWindow)
		if w.empty() {
			delete(d.abuse, k)
		}
		switch {
		case n >= d.opt.AbuseBurst && !d.abusing[k]:
			bursts = append(bursts, burst{k, n})
		case n < d.opt.AbuseBurst && d.abusing[k]:
			delete(d.abusing, k) // the burst is over: a new one alerts again
		}
	}
	for k := range d.abusing {
		if d.abuse[k] == nil {
			delete(d.abusing, k)
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
		return d.enqueue(ctx, tx, a, now, data)
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
		d.raised(KindSpike, 1)
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
	err := d.st.Update(ctx, func(tx *store.Tx) error {
		return d.enqueue(ctx, tx, a, now, data)
	})
	if err != nil {
		return fmt.Errorf("abuse alert: %w", err)
	}
	d.mu.Lock()
	d.abusing[k] = true
	d.mu.Unlock()
	d.raised(KindAbuse, 1)
	return nil
}
