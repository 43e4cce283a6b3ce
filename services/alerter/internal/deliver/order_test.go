package deliver

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/pgtest"
	"quotaflow/services/alerter/internal/store"
)

// newStore returns a Store on a migrated database of the test's own (real
// Postgres; QF_POSTGRES_URL overrides the default), dropped at the end.
func newStore(t *testing.T) *store.Store {
	return store.New(pgtest.Pool(t, "qf_alerter_deliver_test", store.Migrate))
}

// A limit's 80, 90 and 100 % alerts reach the receiver in that order even
// when the first attempt of the 80 % one fails: the others wait for its
// retry, while an alert of another limit does not.
func TestOrderSurvivesRetry(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	var (
		mu       sync.Mutex
		got      []string
		refused  bool
		complete = make(chan struct{})
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		if !refused {
			refused = true
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		got = append(got, string(b))
		if len(got) == 4 {
			close(complete)
		}
	}))
	t.Cleanup(srv.Close)

	err := st.Update(ctx, func(tx *store.Tx) error {
		for _, a := range []store.Alert{
			{ID: "a80", Order: "limit a", Payload: []byte("a 80")},
			{ID: "b80", Order: "limit b", Payload: []byte("b 80")},
			{ID: "a90", Order: "limit a", Payload: []byte("a 90")},
			{ID: "a100", Order: "limit a", Payload: []byte("a 100")},
		} {
			a.Kind = "quota.threshold"
			if err := tx.Enqueue(ctx, a, []string{"ops"}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(st, []Webhook{{Name: "ops", URL: srv.URL, Secret: testSecret, AllowPrivate: true}},
		Options{MinBackoff: 200 * time.Millisecond, Poll: 20 * time.Millisecond}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { d.Run(runCtx) })
	defer func() { stop(); wg.Wait() }()
	select {
	case <-complete:
	case <-time.After(30 * time.Second):
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("after 30s the receiver has %q, want 4 alerts", got)
	}
	mu.Lock()
	defer mu.Unlock()
	var a []string
	for _, g := range got {
		if g[0] == 'a' {
			a = append(a, g)
		}
	}
	if want := []string{"a 80", "a 90", "a 100"}; !slices.Equal(a, want) {
		t.Errorf("limit a's alerts arrived as %q, want %q (all received: %q)", a, want, got)
	}
	if got[0] != "b 80" {
		t.Errorf("first alert received %q, want b 80: another limit's alert does not wait for a's retry", got[0])
	}
}
