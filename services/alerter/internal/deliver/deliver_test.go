package deliver

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/services/alerter/internal/store"
)

const testSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

// verify checks a Standard Webhooks signature independently of the
// library the alerter signs with: HMAC-SHA256 of "id.timestamp.body" with
// the base64-decoded secret, compared with every "v1,<base64>" entry.
func verify(t *testing.T, secret string, h http.Header, body []byte) bool {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(h.Get("webhook-id") + "." + h.Get("webhook-timestamp") + "." + string(body)))
	want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
	for _, sig := range strings.Fields(h.Get("webhook-signature")) {
		if hmac.Equal([]byte(sig), []byte(want)) {
			return true
		}
	}
	return false
}

// fakeOutbox holds deliveries in memory: the Outbox interface, no Postgres.
type fakeOutbox struct {
	mu     sync.Mutex
	due    []store.Delivery
	done   map[int64]int
	failed map[int64]string
	dead   map[int64]bool
	pruned []time.Time // the before of each PruneOutbox
}

func (f *fakeOutbox) Claim(_ context.Context, n int, _, _ time.Duration, _ []string) ([]store.Delivery, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n = min(n, len(f.due))
	out := f.due[:n]
	f.due = f.due[n:]
	return out, nil
}

func (f *fakeOutbox) Extend(context.Context, int64, int, time.Duration) (bool, error) {
	return true, nil
}

func (f *fakeOutbox) Delivered(_ context.Context, id int64, status int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.done[id] = status
	return nil
}

func (f *fakeOutbox) Failed(_ context.Context, id int64, cause string, _ int, _, _ time.Duration, permanent bool) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failed[id] = cause
	if permanent {
		f.dead[id] = true
		return store.StatusDead, nil
	}
	return store.StatusPending, nil
}

func (f *fakeOutbox) PruneOutbox(_ context.Context, before time.Time) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pruned = append(f.pruned, before)
	return 0, nil
}

func newFake(ds ...store.Delivery) *fakeOutbox {
	return &fakeOutbox{due: ds, done: map[int64]int{}, failed: map[int64]string{}, dead: map[int64]bool{}}
}

type captured struct {
	header http.Header
	body   []byte
}

func receiver(t *testing.T) (*httptest.Server, chan captured) {
	got := make(chan captured, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- captured{r.Header.Clone(), b}
	}))
	t.Cleanup(srv.Close)
	return srv, got
}

func TestSignedDelivery(t *testing.T) {
	srv, got := receiver(t)
	var logs bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	payload := []byte(`{"type":"quota.threshold","timestamp":"2026-01-01T00:00:00Z","data":{"tenant":"acme"}}`)
	ob := newFake(store.Delivery{ID: 1, AlertID: "a1", Webhook: "ops", Kind: "quota.threshold", Payload: payload})
	d, err := New(ob, []Webhook{{Name: "ops", URL: srv.URL, Secret: testSecret, AllowPrivate: true}}, Options{}, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Once(context.Background()); err != nil {
		t.Fatal(err)
	}
	c := <-got
	if ob.done[1] != http.StatusOK {
		t.Fatalf("delivery 1 not marked delivered: %v", ob.done)
	}
	if !bytes.Equal(c.body, payload) {
		t.Errorf("body = %s, want %s", c.body, payload)
	}
	if id := c.header.Get("webhook-id"); id != MessageID("a1", "ops") {
		t.Errorf("webhook-id = %q, want %q", id, MessageID("a1", "ops"))
	}
	if !verify(t, testSecret, c.header, c.body) {
		t.Errorf("signature %q does not verify", c.header.Get("webhook-signature"))
	}
	tampered := bytes.Replace(c.body, []byte("acme"), []byte("acmf"), 1)
	if verify(t, testSecret, c.header, tampered) {
		t.Errorf("signature verifies a tampered body")
	}
	if verify(t, "whsec_"+base64.StdEncoding.EncodeToString([]byte("another-secret-key!")), c.header, c.body) {
		t.Errorf("signature verifies with another secret")
	}
	if strings.Contains(logs.String(), strings.TrimPrefix(testSecret, "whsec_")) {
		t.Errorf("logs contain the secret: %s", logs.String())
	}
}

func TestPrivateAddressRefused(t *testing.T) {
	srv, got := receiver(t)
	ob := newFake(store.Delivery{ID: 1, AlertID: "a1", Webhook: "ops", Payload: []byte(`{}`)})
	d, err := New(ob, []Webhook{{Name: "ops", URL: srv.URL, Secret: testSecret}}, Options{}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Once(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !ob.dead[1] || !strings.Contains(ob.failed[1], ErrForbiddenAddress.Error()) {
		t.Fatalf("delivery to %s: dead %v, error %q; want dead, %q", srv.URL, ob.dead[1], ob.failed[1], ErrForbiddenAddress)
	}
	if strings.Contains(ob.failed[1], srv.URL) {
		t.Errorf("stored error %q contains the URL", ob.failed[1])
	}
	select {
	case c := <-got:
		t.Fatalf("receiver got a request: %s", c.body)
	default:
	}
}

func TestPublic(t *testing.T) {
	for _, tt := range []struct {
		addr string
		want bool
	}{
		{"93.184.216.34", true}, {"2606:4700::1111", true},
		{"127.0.0.1", false}, {"::1", false}, {"10.1.2.3", false}, {"172.16.0.1", false}, {"192.168.1.1", false},
		{"169.254.169.254", false}, {"fe80::1", false}, {"fd00::1", false}, {"0.0.0.0", false}, {"::", false},
		{"::ffff:127.0.0.1", false}, {"::ffff:10.0.0.1", false}, {"100.64.0.1", false}, {"224.0.0.1", false},
		// IPv6 carrying an IPv4 address: judged by it too
		{"64:ff9b::a00:1", false}, {"64:ff9b::7f00:1", false}, {"64:ff9b::808:808", true}, {"64:ff9b:1::1", false},
		{"2002:7f00:1::1", false}, {"2002:a9fe:a9fe::1", false}, {"2002:808:808::1", true},
		{"::7f00:1", false}, {"::808:808", true}, {"::ffff:0:7f00:1", false}, {"::ffff:0:808:808", true},
	} {
		if got := Public(netip.MustParseAddr(tt.addr)); got != tt.want {
			t.Errorf("Public(%s) = %v, want %v", tt.addr, got, tt.want)
		}
	}
}

func TestPublicOnlyDialer(t *testing.T) {
	err := publicOnly("tcp", "127.0.0.1:80", nil)
	if !errors.Is(err, ErrForbiddenAddress) {
		t.Errorf("publicOnly(127.0.0.1:80) = %v, want %v", err, ErrForbiddenAddress)
	}
	if err := publicOnly("tcp", "93.184.216.34:443", nil); err != nil {
		t.Errorf("publicOnly(93.184.216.34:443) = %v, want nil", err)
	}
}

func TestBackoff(t *testing.T) {
	d := &Deliverer{opt: Options{MinBackoff: time.Second, MaxBackoff: time.Minute}.withDefaults()}
	for _, tt := range []struct {
		attempts int
		base     time.Duration
	}{{1, time.Second}, {2, 2 * time.Second}, {4, 8 * time.Second}, {7, time.Minute}, {100, time.Minute}} {
		for range 20 {
			if got := d.backoff(tt.attempts); got < tt.base/2 || got > tt.base {
				t.Fatalf("backoff(%d) = %v, want within [%v, %v]", tt.attempts, got, tt.base/2, tt.base)
			}
		}
	}
}

func TestParse(t *testing.T) {
	kinds := []string{"quota.threshold", "quota.denial_spike"}
	good := `webhooks:
  - name: ops
    url: https://hooks.example.com/quota
    secret: ` + testSecret + `
    kinds: [quota.threshold]
    tenants: [acme]
    min_threshold: 90
`
	hooks, err := Parse([]byte(good), kinds)
	if err != nil {
		t.Fatal(err)
	}
	if len(hooks) != 1 || !hooks[0].Wants("quota.threshold", "acme", 90) || !hooks[0].Wants("quota.threshold", "acme", 100) ||
		hooks[0].Wants("quota.threshold", "acme", 89) || hooks[0].Wants("quota.threshold", "other", 90) ||
		hooks[0].Wants("quota.denial_spike", "acme", 0) {
		t.Errorf("Parse = %+v: wrong routing", hooks)
	}
	if hooks, err := Parse(nil, kinds); err != nil || len(hooks) != 0 {
		t.Errorf("Parse(empty) = %v, %v; want no webhooks", hooks, err)
	}
	for _, tt := range []struct{ name, yaml, want string }{
		{"unknown field", "webhooks: [{name: a, url: 'https://x.example', secret: " + testSecret + ", colour: red}]", "colour"},
		{"bad secret", "webhooks: [{name: a, url: 'https://x.example', secret: 'whsec_!!topsecret!!'}]", "webhooks[0].secret"},
		{"bad url", "webhooks: [{name: a, url: 'ftp://x.example', secret: " + testSecret + "}]", "webhooks[0].url"},
		{"bad kind", "webhooks: [{name: a, url: 'https://x.example', secret: " + testSecret + ", kinds: [nope]}]", "webhooks[0].kinds[0]"},
		{"min_threshold too high", "webhooks: [{name: a, url: 'https://x.example', secret: " + testSecret + ", min_threshold: 101}]", "webhooks[0].min_threshold: 101 is not a percentage from 0 to 100"},
		{"min_threshold negative", "webhooks: [{name: a, url: 'https://x.example', secret: " + testSecret + ", min_threshold: -1}]", "webhooks[0].min_threshold: -1"},
		{"empty tenant", "webhooks: [{name: cust, url: 'https://x.example', secret: " + testSecret + ", tenants: [acme, '']}]", `webhooks[0].tenants[1] of webhook "cust": not a tenant id: empty`},
		{"tenant with a NUL", "webhooks: [{name: cust, url: 'https://x.example', secret: " + testSecret + ", tenants: [\"a\\0\"]}]", `webhooks[0].tenants[0] of webhook "cust": not a tenant id: contains a control character`},
		{"duplicate", "webhooks: [{name: a, url: 'https://x.example', secret: " + testSecret + "}, {name: a, url: 'https://x.example', secret: " + testSecret + "}]", "appears twice"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml), kinds)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse = %v, want an error naming %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "topsecret") || strings.Contains(err.Error(), strings.TrimPrefix(testSecret, "whsec_")) {
				t.Errorf("error %q contains a secret", err)
			}
		})
	}
}

// TestRetain: the outbox is pruned of what is older than Retention at
// start, then every hour, until the deliverer stops.
func TestRetain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ob := newFake()
		d, err := New(ob, nil, Options{Retention: 48 * time.Hour}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { d.Retain(ctx); close(done) }()
		time.Sleep(150 * time.Minute)
		synctest.Wait()
		cancel()
		<-done
		want := []time.Time{start.Add(-48 * time.Hour), start.Add(-47 * time.Hour), start.Add(-46 * time.Hour)}
		if !slices.EqualFunc(ob.pruned, want, time.Time.Equal) {
			t.Errorf("pruned before %v, want %v", ob.pruned, want)
		}
	})
}
