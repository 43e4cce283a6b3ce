package deliver

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"
)

// Options tune delivery. The zero value of a field means its default.
type Options struct {
	// AttemptTimeout bounds one HTTP attempt.
	AttemptTimeout time.Duration
	// MinBackoff is the delay after the first failed attempt; it doubles
	// per attempt.
	MinBackoff time.Duration
	// MaxBackoff caps the delay between attempts.
	MaxBackoff time.Duration
	// MaxAge is how long a delivery is retried before it is dead.
	MaxAge time.Duration
	// Poll is how often the outbox is checked when nothing wakes the
	// deliverer.
	Poll time.Duration
	// Batch is the most deliveries one claim takes; each webhook's are
	// sent one after another, webhooks in parallel, and a webhook with an
	// attempt running is not claimed for until its attempts end.
	Batch int
	// Retention is how long delivered and dead deliveries stay in the
	// outbox, which is also the log of a tenant's recent alerts.
	Retention time.Duration
}

// Defaults of Options: an attempt gets 10 s; retries wait 1 s doubling up
// to 5 m and go on for a day.
const (
	DefaultAttemptTimeout = 10 * time.Second
	DefaultMinBackoff     = time.Second
	DefaultMaxBackoff     = 5 * time.Minute
	DefaultMaxAge         = 24 * time.Hour
	DefaultPoll           = time.Second
	DefaultBatch          = 16
	DefaultRetention      = 30 * 24 * time.Hour
)

func (o Options) withDefaults() Options {
	if o.AttemptTimeout == 0 {
		o.AttemptTimeout = DefaultAttemptTimeout
	}
	if o.MinBackoff == 0 {
		o.MinBackoff = DefaultMinBackoff
	}
	if o.MaxBackoff == 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	if o.MaxAge == 0 {
		o.MaxAge = DefaultMaxAge
	}
	if o.Poll == 0 {
		o.Poll = DefaultPoll
	}
	if o.Batch == 0 {
		o.Batch = DefaultBatch
	}
	if o.Retention == 0 {
		o.Retention = DefaultRetention
	}
	return o
}

// Outbox is the part of store.Store the Deliverer uses.
type Outbox interface {
	Claim(ctx context.Context, n int, lease, maxAge time.Duration, skip []string) ([]store.Delivery, error)
	Extend(ctx context.Context, id int64, attempts int, lease time.Duration) (bool, error)
	Delivered(ctx context.Context, id int64, status int) error
	Failed(ctx context.Context, id int64, cause string, status int, backoff, maxAge time.Duration, permanent bool) (string, error)
	PruneOutbox(ctx context.Context, before time.Time) (int64, error)
}

type endpoint struct {
	hook   Webhook
	signer *standardwebhooks.Webhook
	client *http.Client
}

// Deliverer sends the outbox's due deliveries. Run owns its loop; Notify
// wakes it early. It is safe for concurrent use. Create it with New.
type Deliverer struct {
	ob      Outbox
	opt     Options
	log     *slog.Logger
	results *prometheus.CounterVec
	wake    chan struct{}

	mu    sync.RWMutex
	hooks map[string]*endpoint // by name
	list  []Webhook            // in file order, for Route

	flyMu  sync.Mutex
	flying map[string]bool // the webhooks with attempts running, by name
}

// Results of quotaflow_webhook_deliveries_total: one per attempt.
const (
	ResultDelivered = "delivered" // 2xx
	ResultFailed    = "failed"    // will be retried
	ResultDead      = "dead"      // given up: too old, refused address, unknown webhook or one that no longer takes it
)

// New returns a Deliverer over ob sending to hooks, counting attempts in
// quotaflow_webhook_deliveries_total{result} on reg. Without hooks it
// warns that alerts are detected and counted but not sent.
func New(ob Outbox, hooks []Webhook, opt Options, log *slog.Logger, reg prometheus.Registerer) (*Deliverer, error) {
	d := &Deliverer{
		ob: ob, opt: opt.withDefaults(), log: log.With("component", "deliver"),
		hooks: map[string]*endpoint{}, wake: make(chan struct{}, 1), flying: map[string]bool{},
	}
	if err := d.SetWebhooks(hooks); err != nil {
		return nil, err
	}
	if len(hooks) == 0 {
		d.log.Warn("no webhooks configured: alerts are detected and counted but not sent")
	}
	d.results = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_webhook_deliveries_total",
		Help: "Webhook delivery attempts, by result (delivered, failed: retried later, dead: given up).",
	}, []string{"result"})
	for _, r := range []string{ResultDelivered, ResultFailed, ResultDead} {
		d.results.WithLabelValues(r)
	}
	if err := reg.Register(d.results); err != nil {
		return nil, fmt.Errorf("register delivery metrics: %w", err)
	}
	return d, nil
}

// SetWebhooks replaces the webhooks alerts are routed and sent to (a
// reload of QF_WEBHOOKS_FILE). It changes nothing when one of them is
// unusable. Deliveries already queued for a webhook that is gone, or that
// its new kinds, tenants or min_threshold no longer take, are marked dead
// at their next attempt; attempts in flight finish with the endpoint they
// started with.
func (d *Deliverer) SetWebhooks(hooks []Webhook) error {
	d.mu.RLock()
	old := d.hooks
	d.mu.RUnlock()
	next := make(map[string]*endpoint, len(hooks))
	for _, h := range hooks {
		if ep := old[h.Name]; ep != nil && reflect.DeepEqual(ep.hook, h) {
			next[h.Name] = ep // unchanged: keep its connections
			continue
		}
		key, err := DecodeSecret(h.Secret)
		if err != nil {
			return fmt.Errorf("webhook %s secret: %w", h.Name, err)
		}
		signer, err := standardwebhooks.NewWebhookRaw(key)
		if err != nil {
			return fmt.Errorf("webhook %s signer: %w", h.Name, err)
		}
		next[h.Name] = &endpoint{hook: h, signer: signer, client: newClient(h.AllowPrivate)}
	}
	d.mu.Lock()
	old = d.hooks
	d.hooks, d.list = next, slices.Clone(hooks)
	d.mu.Unlock()
	for name, ep := range old {
		if next[name] != ep {
			ep.client.CloseIdleConnections()
		}
	}
	return nil
}

// Webhooks returns the webhooks in force, in file order.
func (d *Deliverer) Webhooks() []Webhook {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return slices.Clone(d.list)
}

// Route names the webhooks in force that want an alert of kind for
// tenant, of threshold (0 but for thresholds); it fits detect.Router and
// follows SetWebhooks.
func (d *Deliverer) Route(kind, tenant string, threshold int) []string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	var names []string
	for _, w := range d.list {
		if w.Wants(kind, tenant, threshold) {
			names = append(names, w.Name)
		}
	}
	return names
}

// Notify wakes Run to look at the outbox now; it never blocks.
func (d *Deliverer) Notify() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// Run sends due deliveries until ctx ends: at each Notify, every Poll and
// whenever a webhook's attempts end. Attempts in flight when ctx ends are
// cut short and retried later; Run returns once they have.
func (d *Deliverer) Run(ctx context.Context) {
	t := time.NewTicker(d.opt.Poll)
	defer t.Stop()
	var flights sync.WaitGroup
	defer flights.Wait()
	report := func(err error) {
		if ctx.Err() == nil {
			d.log.Error("deliver alerts", "err", err)
		}
	}
	for {
		for {
			n, err := d.launch(ctx, &flights, report)
			if err != nil {
				report(err)
			}
			if err != nil || n < d.opt.Batch {
				break // more may be due: loop only when the batch was full
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-t.C:
		}
	}
}

// pruneEvery is how often Retain prunes the outbox.
const pruneEvery = time.Hour

// Retain deletes the delivered and dead deliveries older than Retention,
// at once and then every pruneEvery, until ctx ends.
func (d *Deliverer) Retain(ctx context.Context) {
	t := time.NewTicker(pruneEvery)
	defer t.Stop()
	for {
		n, err := d.ob.PruneOutbox(ctx, time.Now().Add(-d.opt.Retention))
		switch {
		case err != nil && ctx.Err() == nil:
			d.log.Error("prune the outbox", "err", err)
		case n > 0:
			d.log.Info("pruned the outbox", "deleted", n, "retention", d.opt.Retention.String())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Once claims up to Batch due deliveries (see launch), attempts them and
// records each outcome, waiting for every attempt. It returns how many it
// claimed.
func (d *Deliverer) Once(ctx context.Context) (int, error) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	n, err := d.launch(ctx, &wg, func(err error) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, err)
	})
	wg.Wait()
	return n, errors.Join(append(errs, err)...)
}

// launch claims up to Batch due deliveries (oldest first; of an ordered
// group of alerts only the earliest pending, see store.Claim) of the
// webhooks with no attempt running, and starts one goroutine per webhook
// in wg attempting its deliveries in outbox order: one connection at a
// time per receiver, and a receiver that hangs holds back only its own
// alerts. It reports the goroutines' errors to report and returns how
// many deliveries it claimed. A webhook whose attempts end wakes Run, as
// its next delivery may be due (the next alert of a group once the earlier
// is delivered or dead: a jump across three thresholds goes out in three
// claims in a row, not one per Poll).
func (d *Deliverer) launch(ctx context.Context, wg *sync.WaitGroup, report func(error)) (int, error) {
	// The lease outlasts an attempt, so nobody retries one in flight; if
	// this process dies mid-attempt, the delivery is due again after it.
	lease := d.opt.AttemptTimeout + 5*time.Second
	// Held from reading the busy webhooks to marking the claimed ones, so
	// no two flights of one webhook overlap.
	d.flyMu.Lock()
	defer d.flyMu.Unlock()
	batch, err := d.ob.Claim(ctx, d.opt.Batch, lease, d.opt.MaxAge, slices.Collect(maps.Keys(d.flying)))
	if err != nil {
		return 0, err
	}
	byHook := map[string][]store.Delivery{}
	for _, dl := range batch {
		if dl.Status == store.StatusDead { // past MaxAge: Claim gave it up
			d.dead(d.logger(dl), dl.LastError)
			d.Notify() // the next alert of its group is due
			continue
		}
		byHook[dl.Webhook] = append(byHook[dl.Webhook], dl)
	}
	for name, dls := range byHook {
		d.flying[name] = true
		wg.Go(func() {
			defer func() {
				d.flyMu.Lock()
				delete(d.flying, name)
				d.flyMu.Unlock()
				d.Notify()
			}()
			for i, dl := range dls {
				if ctx.Err() != nil {
					return // shutting down: the leases pass and they are retried
				}
				if i > 0 { // claimed with the first, its lease ran while they were attempted
					if ok, err := d.ob.Extend(ctx, dl.ID, dl.Attempts, lease); err != nil || !ok {
						if err != nil {
							report(err)
						}
						continue // another claim has it now, or it is due again
					}
				}
				if err := d.attempt(ctx, dl); err != nil {
					report(err)
				}
			}
		})
	}
	return len(batch), nil
}

// MessageID is the webhook-id of an alert sent to a webhook: stable across
// retries and restarts, so receivers drop repeats.
func MessageID(alertID, webhook string) string {
	h := sha256.Sum256([]byte(alertID + "\x00" + webhook))
	return "msg_" + hex.EncodeToString(h[:16])
}

func (d *Deliverer) attempt(ctx context.Context, dl store.Delivery) error {
	log := d.logger(dl)
	d.mu.RLock()
	ep := d.hooks[dl.Webhook]
	d.mu.RUnlock()
	if ep == nil {
		return d.fail(ctx, log, dl, "webhook not configured", 0, true)
	}
	// Routing chose the webhook when the alert was queued; a reload since
	// may have narrowed its filters, or pointed its name at another
	// receiver (another tenant's).
	if !ep.hook.Wants(dl.Kind, dl.Tenant, threshold(dl)) {
		return d.fail(ctx, log, dl, "webhook no longer takes this alert (its kinds, tenants or min_threshold changed)", 0, true)
	}
	status, err := ep.send(ctx, MessageID(dl.AlertID, dl.Webhook), dl.Payload, d.opt.AttemptTimeout)
	if ctx.Err() != nil {
		return nil // shutting down: the lease passes and it is retried
	}
	switch {
	case err != nil:
		return d.fail(ctx, log, dl, err.Error(), 0, errors.Is(err, ErrForbiddenAddress))
	case status < 200 || status > 299:
		return d.fail(ctx, log, dl, "receiver answered "+strconv.Itoa(status), status, false)
	}
	if err := d.ob.Delivered(ctx, dl.ID, status); err != nil {
		return err
	}
	d.results.WithLabelValues(ResultDelivered).Inc()
	log.Debug("alert delivered", "status", status)
	return nil
}

// threshold is the percentage a quota.threshold delivery's body names, 0
// for other kinds (as Route was given it).
func threshold(dl store.Delivery) int {
	if dl.Kind != detect.KindThreshold {
		return 0
	}
	var b struct {
		Data struct {
			Threshold int `json:"threshold"`
		} `json:"data"`
	}
	_ = json.Unmarshal(dl.Payload, &b) // the alerter wrote it: a body without one is 0
	return b.Data.Threshold
}

func (d *Deliverer) fail(ctx context.Context, log *slog.Logger, dl store.Delivery, cause string, status int, permanent bool) error {
	st, err := d.ob.Failed(ctx, dl.ID, cause, status, d.backoff(dl.Attempts), d.opt.MaxAge, permanent)
	if err != nil {
		return err
	}
	if st == store.StatusDead {
		d.dead(log, cause)
		return nil
	}
	d.results.WithLabelValues(ResultFailed).Inc()
	log.Info("alert delivery failed; will retry", "err", cause)
	return nil
}

func (d *Deliverer) logger(dl store.Delivery) *slog.Logger {
	return d.log.With("alert_id", dl.AlertID, "webhook", dl.Webhook, "kind", dl.Kind, "attempt", dl.Attempts)
}

// dead counts and logs a delivery given up.
func (d *Deliverer) dead(log *slog.Logger, cause string) {
	d.results.WithLabelValues(ResultDead).Inc()
	log.Warn("alert delivery dead: giving up", "err", cause)
}

// backoff is the delay after the attempts-th failed attempt: MinBackoff
// doubling per attempt up to MaxBackoff, with jitter taking it anywhere in
// its upper half, so receivers recovering from an outage are not hit by
// every alerter at once.
func (d *Deliverer) backoff(attempts int) time.Duration {
	b := d.opt.MaxBackoff
	if attempts >= 1 && attempts < 31 {
		b = min(d.opt.MinBackoff<<(attempts-1), d.opt.MaxBackoff)
	}
	return b/2 + rand.N(b/2+1)
}

// send POSTs one signed body and returns the receiver's status. Its
// errors never contain the URL (webhook URLs often embed a token).
func (ep *endpoint) send(ctx context.Context, msgID string, body []byte, timeout time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	now := time.Now()
	sig, err := ep.signer.Sign(msgID, now, body)
	if err != nil {
		return 0, fmt.Errorf("sign: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.hook.URL, bytes.NewReader(body))
	if err != nil {
		return 0, errors.New("build request: invalid webhook url")
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "quotaflow-alerter")
	req.Header.Set(standardwebhooks.HeaderWebhookID, msgID)
	req.Header.Set(standardwebhooks.HeaderWebhookTimestamp, strconv.FormatInt(now.Unix(), 10))
	req.Header.Set(standardwebhooks.HeaderWebhookSignature, sig)
	resp, err := ep.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // drop the URL
		}
		return 0, fmt.Errorf("post: %w", err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}
