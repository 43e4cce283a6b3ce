package deliver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/pgtest"
	"quotaflow/services/alerter/internal/store"
)

// A reload that narrows a webhook's filters, or points its name at
// another receiver for another tenant, sends none of the deliveries queued
// under its old filters: they die at their next attempt, as a removed
// webhook's do, and those it still takes go out.
func TestReloadedFiltersDropPending(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, "qf_alerter_deliver_reload", store.Migrate)
	st := store.New(pool)
	var up atomic.Bool // the first receiver is down until the reload
	got := make(chan string, 8)
	recv := func(name string, down *atomic.Bool) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if down != nil && !down.Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			b, _ := io.ReadAll(r.Body)
			got <- name + " " + string(b)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	acme, globex := recv("acme", &up), recv("globex", nil)
	customer := Webhook{Name: "customer", URL: acme.URL, Secret: testSecret, Tenants: []string{"acme"}, AllowPrivate: true}
	ops := Webhook{Name: "ops", URL: acme.URL, Secret: testSecret, Kinds: []string{"quota.threshold"}, AllowPrivate: true}
	d, err := New(st, []Webhook{customer, ops}, Options{MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond},
		slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []store.Alert{
		{ID: "a80", Tenant: "acme", Payload: []byte(`{"type":"quota.threshold","data":{"tenant":"acme","threshold":80}}`)},
		{ID: "a95", Tenant: "acme", Payload: []byte(`{"type":"quota.threshold","data":{"tenant":"acme","threshold":95}}`)},
	} { // each queued for both webhooks
		a.Kind = "quota.threshold"
		err := st.Update(ctx, func(tx *store.Tx) error { return tx.Enqueue(ctx, a, d.Route(a.Kind, a.Tenant, 80)) })
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.Once(ctx); err != nil { // all refused: they wait for a retry
		t.Fatal(err)
	}

	customer.URL, customer.Tenants = globex.URL, []string{"globex"} // the name now serves another customer
	ops.MinThreshold = 90
	if err := d.SetWebhooks([]Webhook{customer, ops}); err != nil {
		t.Fatal(err)
	}
	up.Store(true)
	time.Sleep(10 * time.Millisecond) // past the backoff
	if _, err := d.Once(ctx); err != nil {
		t.Fatal(err)
	}
	close(got)
	var sent []string
	for g := range got {
		sent = append(sent, g)
	}
	if len(sent) != 1 || !strings.HasPrefix(sent[0], "acme ") || !strings.Contains(sent[0], `"threshold":95`) {
		t.Errorf("after the reload the receivers got %q, want only ops's 95 %% alert", sent)
	}
	rows, err := pool.Query(ctx, `SELECT alert_id || ' ' || webhook, status, last_error FROM webhook_outbox`)
	if err != nil {
		t.Fatal(err)
	}
	var (
		key, status, lastErr string
		dropped              []string
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &status, &lastErr}, func() error {
		if status == store.StatusDead && strings.HasPrefix(lastErr, "webhook no longer takes") {
			dropped = append(dropped, key)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(dropped)
	if want := []string{"a80 customer", "a80 ops", "a95 customer"}; !slices.Equal(dropped, want) {
		t.Errorf("deliveries dead as no longer taken: %q, want %q", dropped, want)
	}
}

// A receiver whose TLS certificate names "evil\x00host" puts a NUL byte in
// the attempt's error, which the outbox stores all the same: before, it
// could not, and the delivery stayed pending, retried at each lease for
// ever, past the max age, holding back the later alerts of its limit.
func TestNulInAttemptErrorIsRecorded(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, "qf_alerter_deliver_nul", store.Migrate)
	st := store.New(pool)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "x"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"evil\x00host"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	hook := Webhook{Name: "cust", URL: strings.Replace(srv.URL, "127.0.0.1", "localhost", 1), Secret: testSecret, AllowPrivate: true}
	d, err := New(st, []Webhook{hook}, Options{MaxAge: time.Nanosecond}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	err = st.Update(ctx, func(tx *store.Tx) error {
		return tx.Enqueue(ctx, store.Alert{ID: "a80", Kind: "quota.threshold", Tenant: "acme", Payload: []byte(`{}`)}, []string{"cust"})
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Once(ctx); err != nil {
		t.Errorf("Once: %v", err)
	}
	var status, lastErr string
	if err := pool.QueryRow(ctx, `SELECT status, last_error FROM webhook_outbox`).Scan(&status, &lastErr); err != nil {
		t.Fatal(err)
	}
	if status != store.StatusDead || !strings.Contains(lastErr, `evil\x00host`) {
		t.Errorf("the failed delivery past the max age is %s, last error %q; want dead, naming evil\\x00host", status, lastErr)
	}
}

// A receiver that hangs holds back only its own webhook's alerts: another
// webhook's new alert goes out while the hanging one's attempts (a claim
// of Batch of them, one after another) run on. Before, each claim waited
// for all its attempts, up to Batch × AttemptTimeout: here ten minutes
// each, so the other alert never came before the test's deadline.
func TestHangingReceiverDelaysNoOther(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	st := newStore(t)
	hanging := make(chan struct{}, 1)
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // so that the server sees the client go
		select {
		case hanging <- struct{}{}:
		default:
		}
		<-r.Context().Done() // answers nothing while the test runs
	}))
	t.Cleanup(hang.Close)
	fast, got := receiver(t)
	hooks := []Webhook{
		{Name: "hang", URL: hang.URL, Secret: testSecret, Tenants: []string{"t1"}, AllowPrivate: true},
		{Name: "fast", URL: fast.URL, Secret: testSecret, Tenants: []string{"t2"}, AllowPrivate: true},
	}
	d, err := New(st, hooks, Options{AttemptTimeout: 10 * time.Minute}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(id, tenant string) {
		t.Helper()
		err := st.Update(ctx, func(tx *store.Tx) error {
			return tx.Enqueue(ctx, store.Alert{ID: id, Kind: "quota.threshold", Tenant: tenant, Payload: []byte(id)}, d.Route("quota.threshold", tenant, 80))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for i := range DefaultBatch {
		enqueue(fmt.Sprint("t1-", i), "t1")
	}
	var wg sync.WaitGroup
	wg.Go(func() { d.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	select { // the hanging receiver's attempts are under way
	case <-hanging:
	case <-time.After(30 * time.Second):
		t.Fatal("the hanging receiver got no attempt")
	}

	enqueue("t2", "t2")
	d.Notify() // as the detector does after queueing
	select {
	case c := <-got:
		if string(c.body) != "t2" {
			t.Errorf("the receiver got %q, want t2", c.body)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("t2's alert never reached its receiver")
	}
}
