package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/detect"
)

// TestWebhooksReload changes QF_WEBHOOKS_FILE under a running alerter: a
// valid edit takes effect without restart, an invalid one is rejected with
// the path of the mistake and the last good webhooks keep receiving, and
// SIGHUP reloads too.
func TestWebhooksReload(t *testing.T) {
	e := newEnv(t, `webhooks:
  - name: ops
    url: $URL
    secret: $SECRET
    tenants: [globex]
    allow_private: true
`)
	logs := &e2e.Buffer{}
	e.start(logs)
	write := func(content string) {
		t.Helper()
		writeWebhooks(t, e.cfg.WebhooksFile, content, e.recv.srv.URL)
	}
	// crossing publishes a threshold crossing of a new acme user every
	// 100 ms until an alert arrives (bounded by eventually).
	users := 0
	crossing := func(what string) {
		t.Helper()
		before := len(e.recv.of(detect.KindThreshold))
		next := time.Now()
		e2e.Eventually(e.t, what, func() bool {
			if time.Now().After(next) {
				users++
				e.publish(reserved("acme", fmt.Sprintf("u%d", users), "r", 1, 0, time.Now().UTC(), userLimit(850, 0)))
				next = time.Now().Add(100 * time.Millisecond)
			}
			return len(e.recv.of(detect.KindThreshold)) > before
		})
	}

	// acme's alerts go nowhere yet; the edit routes them to ops.
	write(opsHook)
	crossing("acme alert after the reload")

	// An invalid edit is rejected, precisely, and ops keeps receiving.
	write(opsHook + `  - name: broken
    url: ftp://hooks.example.com/x
    secret: $SECRET
`)
	e2e.Eventually(e.t, "rejection logged", func() bool { return strings.Contains(logs.String(), "webhooks[1].url") })
	if !strings.Contains(logs.String(), e.cfg.WebhooksFile) {
		t.Errorf("rejection does not name the file %s: %s", e.cfg.WebhooksFile, logs.String())
	}
	crossing("acme alert with the last good webhooks")

	// SIGHUP reloads (the same broken content: rejected again).
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(e.t, "reload on SIGHUP", func() bool { return strings.Contains(logs.String(), `"trigger":"SIGHUP"`) })
	if strings.Contains(logs.String(), strings.TrimPrefix(testSecret, "whsec_")) {
		t.Errorf("logs contain the webhook secret")
	}
}

// TestPolicyReloadReArmsRemovedLimits edits QF_POLICY_FILE under a running
// alerter: the raised threshold of a limit the edit removed is re-armed,
// the one of a limit it keeps stays fired.
func TestPolicyReloadReArmsRemovedLimits(t *testing.T) {
	e := newEnv(t, opsHook)
	const policy = `default_plan: free
plans:
  free:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 1000}]
`
	e.writePolicy([]byte(strings.Replace(policy, "]\n", ", {name: old, kind: rolling, window: 1h, limit: 1000}]\n", 1)))
	e.start(nil)
	old := userLimit(850, 0)
	old.Name = "old"
	e.publish(reserved("acme", "u", "r", 1, 0, time.Now().UTC(), userLimit(850, 0), old))
	levels := func() string {
		t.Helper()
		rows, err := e.pg.Query(context.Background(), `SELECT name, level FROM alert_limits WHERE tenant = 'acme' ORDER BY name`)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for rows.Next() {
			var name string
			var level int
			if err := rows.Scan(&name, &level); err != nil {
				t.Fatal(err)
			}
			out = append(out, fmt.Sprintf("%s %d", name, level))
		}
		return strings.Join(out, ", ")
	}
	e2e.EventuallyLast(t, "both limits raised", func() (bool, string) { l := levels(); return l == "5h 80, old 80", l })

	e.writePolicy([]byte(policy))
	e2e.EventuallyLast(t, "old re-armed", func() (bool, string) { l := levels(); return l == "5h 80, old 0", l })
}

// TestPolicyAlertsAndMinThreshold runs the alerter with QF_POLICY_FILE and
// a webhook with min_threshold: each limit alerts at its policy's
// percentages (a token bucket refilling at none), the webhook body's
// threshold is the percentage crossed, a jump sends them in order once,
// the webhook drops those under its min_threshold, and a policy edit
// changes the thresholds without restart.
func TestPolicyAlertsAndMinThreshold(t *testing.T) {
	e := newEnv(t, opsHook+"    min_threshold: 50\n")
	const policyFmt = `default_plan: free
plans:
  free:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 1000, alerts: %s}]
    rates: [{name: rps, kind: token_bucket, rate: 10, per: 1s, burst: 10}]
`
	e.writePolicy(fmt.Appendf(nil, policyFmt, "[40, 60, 100]"))
	e.start(nil)
	rps := func(used int64) events.LimitState {
		return events.LimitState{Scope: "user", Name: "rps", Unit: "requests", Limit: 10, Used: used, Remaining: 10 - used}
	}
	at := time.Now().UTC()
	var v int64
	for _, used := range []int64{10, 0, 10, 0, 10} { // the bucket empties and refills
		v++
		e.publish(reserved("acme", "u", fmt.Sprintf("r%d", v), v, 0, at, rps(used), userLimit(0, 0)))
	}
	v++
	e.publish(reserved("acme", "u", "jump", v, 0, at, rps(10), userLimit(1000, 0))) // 0 -> 100 %
	e2e.EventuallyLast(t, "the jump's alerts", func() (bool, string) {
		got := strings.Join(thresholds(t, e.recv.of(detect.KindThreshold)), ", ")
		return got == "acme/u 5h 60, acme/u 5h 100", got
	})

	// The edit: 5h alerts at 70 only. New users at 75 % alert 60 until
	// the reload is in force, then 70.
	e.writePolicy(fmt.Appendf(nil, policyFmt, "[70]"))
	users, next := 0, time.Now()
	e2e.Eventually(t, "70 % alert after the reload", func() bool {
		if time.Now().After(next) {
			users++
			e.publish(reserved("acme", fmt.Sprintf("n%d", users), "r", 1, 0, time.Now().UTC(), userLimit(750, 0)))
			next = time.Now().Add(100 * time.Millisecond)
		}
		for _, a := range thresholds(t, e.recv.of(detect.KindThreshold)) {
			if strings.HasSuffix(a, " 5h 70") {
				return true
			}
		}
		return false
	})
	for _, a := range thresholds(t, e.recv.of(detect.KindThreshold)) {
		if !strings.HasSuffix(a, " 60") && !strings.HasSuffix(a, " 70") && !strings.HasSuffix(a, " 100") {
			t.Errorf("alert %q: want only 60, 70 and 100 (40 is under min_threshold, rps alerts at nothing)", a)
		}
	}
	// Every alert queued is in the outbox, the 40 % ones included: the
	// webhook's filter drops them at routing, so none is queued for it.
	for _, d := range e.deliveries(detect.KindThreshold) {
		if strings.Contains(string(d.Payload), `"threshold":40`) {
			t.Errorf("a 40 %% alert was queued for ops: %s", d.Payload)
		}
	}
}
