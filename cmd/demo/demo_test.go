package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// syncBuffer collects the demo's output for the failure message.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestDemo runs the whole demo, shortened, against the real servers (run
// `go tool task deps` first): the three services built and started as
// processes, traffic, ledger and alerts checked, everything stopped.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the three services")
	}
	cfg := defaultConfig()
	cfg.Duration = 8 * time.Second
	cfg.Progress = 2 * time.Second
	cfg.SettleTimeout = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out syncBuffer
	rep, err := run(ctx, cfg, &out)
	defer func() {
		if t.Failed() {
			t.Logf("demo output:\n%s", out.String())
		}
	}()
	if err != nil {
		t.Fatalf("run = %v", err)
	}
	st := rep.Stats
	if n := st.status5xx.Load(); n != 0 {
		t.Errorf("admission answered 5xx %d times: %v", n, st.errs)
	}
	if st.denied.Load() == 0 {
		t.Error("no 429 at all: the hammering users should run their limits dry")
	}
	if st.actualEvents.Load() == 0 {
		t.Fatal("no actual usage sent")
	}
	if !rep.LedgerMatches || rep.Ledger.actualTotal != st.actualSent.Load() {
		t.Errorf("ledger actual total %d, sent %d", rep.Ledger.actualTotal, st.actualSent.Load())
	}
	if rep.Alerts["quota.threshold"] == 0 {
		t.Errorf("no quota.threshold alert received (alerts %v)", rep.Alerts)
	}
	if rep.BadSignatures != 0 {
		t.Errorf("%d deliveries with a bad signature", rep.BadSignatures)
	}
	if !strings.Contains(out.String(), "CHECK ok") {
		t.Error("summary has no CHECK ok line")
	}
	assertCleanedUp(t, cfg, rep.Run)
}

// assertCleanedUp checks that the run left no stream and no database.
func assertCleanedUp(t *testing.T, cfg Config, run string) {
	t.Helper()
	n := namesFor(run)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nats.Connect(cfg.NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{n.stream, n.dlq} {
		if _, err := js.Stream(ctx, s); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("stream %s after the run: %v, want not found", s, err)
		}
	}
	pgURL, err := databaseURL(cfg.PostgresURL, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, pgURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT exists(SELECT 1 FROM pg_database WHERE datname = $1)", n.database).Scan(&exists); err != nil || exists {
		t.Errorf("database %s after the run: exists=%v err=%v", n.database, exists, err)
	}
}

// TestReceiverVerify checks the signature check against a signature made
// here by the spec's recipe, and that tampering is refused.
func TestReceiverVerify(t *testing.T) {
	key := []byte("0123456789abcdef0123")
	secret := "whsec_" + base64.StdEncoding.EncodeToString(key)
	r, err := newReceiver(secret, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.close()
	body := []byte(`{"type":"quota.threshold","data":{}}`)
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	m := hmac.New(sha256.New, key)
	m.Write([]byte("msg_1." + ts + "."))
	m.Write(body)
	sig := "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
	h := http.Header{}
	h.Set("webhook-id", "msg_1")
	h.Set("webhook-timestamp", ts)
	h.Set("webhook-signature", "v1,AAAA "+sig) // a rotated-out signature first
	if err := r.verify(h, body); err != nil {
		t.Errorf("valid signature refused: %v", err)
	}
	if err := r.verify(h, append(body, ' ')); err == nil {
		t.Error("tampered body accepted")
	}
	h.Set("webhook-timestamp", strconv.FormatInt(time.Now().Add(-time.Hour).Unix(), 10))
	if err := r.verify(h, body); err == nil {
		t.Error("stale timestamp accepted")
	}
}
