package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// check waits for the pipeline to settle and checks what the run left in
// admission's answers, the ledger, Redis, the dead-letter stream and the
// webhook receiver.
func (st *stack) check(ctx context.Context, cfg Config, s *e2e.Stats) []check {
	var cs []check
	add := func(name string, ok bool, format string, args ...any) {
		cs = append(cs, check{name: name, ok: ok, detail: fmt.Sprintf(format, args...)})
	}
	add("admission never failed a request", s.Status5xx.Load() == 0 && s.Failed.Load() == 0,
		"%d 5xx %v, %d transport errors or reports given up", s.Status5xx.Load(), s.Unexpected(), s.Failed.Load())

	pipe := st.Pipeline()
	var queued map[string]bool // reserved events an admission instance died with
	if cfg.Cluster {
		queued = st.allows.queuedAtKill(st.API, st.admissionKilled)
		pipe.MayLoseReserved = int64(len(queued))
	}
	l, err := e2e.WaitLedger(ctx, pipe, s, cfg.Settle)
	add("ledger token total equals the actual usage sent", err == nil && l.ActualTotal == s.ActualSent.Load(),
		"ledger %d tokens in %d actual events, sent %d tokens in %d (%v)", l.ActualTotal, l.ActualCount, s.ActualSent.Load(), s.ActualEvents.Load(), err)
	reserved, released := l.EventsByType[events.TypeReserved][0], l.EventsByType[events.TypeReleased][0]
	add("no event counted twice", l.ActualCount == s.ActualEvents.Load() && reserved <= s.Allowed.Load() && released == s.Releases.Load(),
		"ledger: actual events %d (sent %d), reservations %d (allowed admits %d), released events %d (releases %d)",
		l.ActualCount, s.ActualEvents.Load(), reserved, s.Allowed.Load(), released, s.Releases.Load())
	if cfg.Cluster {
		ok, detail := st.reservedLostOnlyAtKill(ctx, queued)
		add("reserved events lost only with the killed admission's queue", ok, "%s", detail)
	} else {
		add("every reserved event in the ledger", reserved == s.Allowed.Load(), "reservations %d, allowed admits %d", reserved, s.Allowed.Load())
	}

	ok, detail := st.windowsMatchLedger(ctx, cfg)
	add("Redis windows equal the ledger", ok, "%s", detail)
	if cfg.Cluster {
		ok, detail = st.tenantKeysOneSlot(ctx)
		add("every tenant's keys in one slot", ok, "%s", detail)
		l := st.loss
		add("the failover lost only reserves of its last second", l.checked > 0 && l.oldest <= replicationWindow,
			"the promoted replica lacks %d of the %d reserves its master acknowledged (%d tokens; the oldest answered %v before the kill, bound %v)",
			l.lost, l.checked, l.lostTokens, l.oldest.Round(time.Millisecond), replicationWindow)
	}
	ok, detail = st.deadLettersEmpty(ctx)
	add("nothing dead-lettered", ok, "%s", detail)
	ok, detail = st.alertsDeliveredOnce(ctx, cfg.Settle)
	add("every alert delivered once", ok, "%s", detail)
	// Decisions made while Redis was down must not alert on usage that
	// never happened.
	thresholds := st.recv.ThresholdAlerts()
	unfounded := s.Unfounded(thresholds)
	detail = fmt.Sprintf("%d of %d threshold alerts claim more usage than the traffic caused", len(unfounded), len(thresholds))
	if len(unfounded) > 0 {
		detail += fmt.Sprintf(", first %s", unfounded[0])
	}
	add("threshold alerts within the usage sent", len(unfounded) == 0, "%s", detail)
	return cs
}

// reservedLostOnlyAtKill checks that every allowed admit whose reserved
// event the ledger lacks was answered by the killed admission instance
// within outboxWindow before its death.
func (st *stack) reservedLostOnlyAtKill(ctx context.Context, queued map[string]bool) (bool, string) {
	missing, err := st.allows.reservedMissing(ctx, st.DBURL)
	if err != nil {
		return false, err.Error()
	}
	var outside []string
	for _, id := range missing {
		if !queued[id] {
			outside = append(outside, id)
		}
	}
	return len(outside) == 0, fmt.Sprintf("%d allowed admits lack their reserved event, %d of them outside the %d the killed instance answered in its last %v (first: %v)",
		len(missing), len(outside), len(queued), outboxWindow, outside[:min(len(outside), 3)])
}

// windowsMatchLedger compares, for every simulated user, the used tokens
// of each token limit admission reports (GET /v1/usage, from Redis) with
// the actual tokens in the ledger. Every reservation is settled by now and
// the whole run lies in the newest buckets of each window, so they must
// be equal.
func (st *stack) windowsMatchLedger(ctx context.Context, cfg Config) (bool, string) {
	ledger, open, err := actualBySubject(ctx, st.DBURL)
	if err != nil {
		return false, err.Error()
	}
	compared, mismatches, off := 0, 0, int64(0)
	first := ""
	deadline := time.Now().Add(cfg.Settle)
	for _, u := range cfg.users() {
		lims, err := st.usage(ctx, u.Tenant, u.Name, deadline)
		if err != nil {
			return false, err.Error()
		}
		want := ledger[[2]string{u.Tenant, u.Name}]
		for _, lim := range lims {
			if lim.Unit != "tokens" {
				continue
			}
			compared++
			if lim.Used != want {
				mismatches++
				off += lim.Used - want
				if first == "" {
					first = fmt.Sprintf(", first %s/%s %s: Redis %d, ledger %d", u.Tenant, u.Name, lim.Name, lim.Used, want)
				}
			}
		}
	}
	if compared == 0 {
		return false, "no token limit reported"
	}
	return mismatches == 0, fmt.Sprintf("%d token windows of %d users compared, %d differ (Redis − ledger %+d tokens in all%s); %d reservations still open",
		compared, len(cfg.users()), mismatches, off, first, open)
}

type usageLimit struct {
	Name string `json:"name"`
	Unit string `json:"unit"`
	Used int64  `json:"used"`
}

// usage asks admission for a subject's limits. A 503 means its Redis read
// failed (a timeout on a loaded host, say) and is safe to retry: usage asks
// again after the Retry-After it names, until deadline.
func (st *stack) usage(ctx context.Context, tenant, user string, deadline time.Time) ([]usageLimit, error) {
	for {
		lims, wait, err := st.usageOnce(ctx, tenant, user)
		if wait == 0 || time.Now().Add(wait).After(deadline) {
			return lims, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w)", err, ctx.Err())
		case <-time.After(wait):
		}
	}
}

// usageOnce makes one GET /v1/usage; on a 503 it returns the error with
// the wait admission asked for (1 s unless its Retry-After names seconds).
func (st *stack) usageOnce(ctx context.Context, tenant, user string) ([]usageLimit, time.Duration, error) {
	q := url.Values{"tenant": {tenant}, "user": {user}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, st.API+"/v1/usage?"+q.Encode(), nil)
	req.Header.Set("Authorization", "Bearer "+st.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		err := fmt.Errorf("GET /v1/usage: %s", resp.Status)
		if resp.StatusCode != http.StatusServiceUnavailable {
			return nil, 0, err
		}
		wait := time.Second
		if n, perr := strconv.Atoi(resp.Header.Get("Retry-After")); perr == nil && n > 0 {
			wait = time.Duration(n) * time.Second
		}
		return nil, wait, err
	}
	var body struct {
		Limits []usageLimit `json:"limits"`
	}
	return body.Limits, 0, json.NewDecoder(resp.Body).Decode(&body)
}

// actualBySubject sums the ledger's actual tokens by (tenant, user) and
// counts the reservations neither settled nor released.
func actualBySubject(ctx context.Context, dbURL string) (map[[2]string]int64, int64, error) {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, 0, err
	}
	defer conn.Close(ctx)
	var open int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM reservations WHERE status = 'open'`).Scan(&open); err != nil {
		return nil, 0, err
	}
	rows, err := conn.Query(ctx, `SELECT tenant, user_id, sum(actual_tokens)::bigint FROM reservations WHERE actual_tokens IS NOT NULL GROUP BY 1, 2`)
	if err != nil {
		return nil, 0, err
	}
	m := map[[2]string]int64{}
	var t, u string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&t, &u, &n}, func() error {
		m[[2]string{t, u}] = n
		return nil
	})
	return m, open, err
}

// deadLettersEmpty checks that no event went to the dead-letter stream:
// an outage must delay events, never poison them.
func (st *stack) deadLettersEmpty(ctx context.Context) (bool, string) {
	nc, err := nats.Connect(st.NATSURL)
	if err != nil {
		return false, err.Error()
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false, err.Error()
	}
	// Events, not messages: a message may be a batch.
	ids, err := stream.EventIDs(ctx, js, stream.Defaults().DLQStream)
	if err != nil {
		return false, err.Error()
	}
	return len(ids) == 0, fmt.Sprintf("%s holds %d events", stream.Defaults().DLQStream, len(ids))
}

// alertsDeliveredOnce waits until the alerter's outbox has nothing
// pending, then checks that an 80 % threshold alert arrived, that every
// alert the outbox holds reached the receiver
// (which drops repeats by webhook-id), that the receiver got nothing
// else, and that every signature verified.
func (st *stack) alertsDeliveredOnce(ctx context.Context, timeout time.Duration) (bool, string) {
	conn, err := pgx.Connect(ctx, st.DBURL)
	if err != nil {
		return false, err.Error()
	}
	defer conn.Close(ctx)
	type row struct{ alertID, webhook, status string }
	var rs []row
	deadline := time.Now().Add(timeout)
	for {
		rs = rs[:0]
		var r row
		rows, err := conn.Query(ctx, `SELECT alert_id, webhook, status FROM webhook_outbox`)
		if err == nil {
			_, err = pgx.ForEachRow(rows, []any{&r.alertID, &r.webhook, &r.status}, func() error {
				rs = append(rs, r)
				return nil
			})
		}
		if err != nil {
			return false, err.Error()
		}
		pending := 0
		for _, r := range rs {
			if r.status == "pending" {
				pending++
			}
		}
		if pending == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	got := st.recv.IDs()
	missing, notDelivered := 0, 0
	want := map[string]bool{}
	for _, r := range rs {
		id := messageID(r.alertID, r.webhook)
		want[id] = true
		if r.status != "delivered" {
			notDelivered++
		}
		if !got[id] {
			missing++
		}
	}
	unknown := 0
	for id := range got {
		if !want[id] {
			unknown++
		}
	}
	// The pipeline end to end: usage crossing 80 % of a quota reached the
	// receiver as a signed webhook.
	_, thresholds, bad, dups, _ := st.recv.Counts()
	ok := thresholds[80] > 0 && missing == 0 && notDelivered == 0 && unknown == 0 && bad == 0
	return ok, fmt.Sprintf("%d alerts in the outbox (%d at 80 %%), %d not delivered, %d never received, %d received that the outbox does not hold, %d bad signatures; %d redeliveries dropped by webhook-id",
		len(rs), thresholds[80], notDelivered, missing, unknown, bad, dups)
}

// messageID is the webhook-id the alerter gives an alert sent to a
// webhook (its deliver.MessageID), recomputed here: the alerter's
// packages are internal to it.
func messageID(alertID, webhook string) string {
	h := sha256.Sum256([]byte(alertID + "\x00" + webhook))
	return "msg_" + hex.EncodeToString(h[:16])
}
