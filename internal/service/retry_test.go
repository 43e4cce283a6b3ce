package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"quotaflow/internal/obs"
)

var discard = slog.New(slog.DiscardHandler)

// Retry waits 100 ms after the first failure, doubling up to 5 s, reports
// the last error in /readyz meanwhile and marks the step ready when it
// succeeds.
func TestRetryBacksOffUntilItSucceeds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ready := obs.NewReadiness("postgres")
		start := time.Now()
		var at []time.Duration
		v, ok := Retry(t.Context(), discard, ready, "postgres", func(context.Context) (int, error) {
			at = append(at, time.Since(start))
			if len(at) < 9 {
				if len(at) > 1 {
					if st, _ := ready.Check(); st.Waiting["postgres"] != fmt.Sprint("down ", len(at)-1) {
						t.Errorf("attempt %d: readyz waiting = %v, want the last error", len(at), st.Waiting)
					}
				}
				return 0, fmt.Errorf("down %d", len(at))
			}
			return 42, nil
		})
		if v != 42 || !ok {
			t.Fatalf("Retry = %v, %v, want 42, true", v, ok)
		}
		want := []time.Duration{0, 100, 300, 700, 1500, 3100, 6300, 11300, 16300}
		for i := range want {
			want[i] *= time.Millisecond
		}
		if fmt.Sprint(at) != fmt.Sprint(want) {
			t.Errorf("attempts at %v, want %v", at, want)
		}
		if _, isReady := ready.Check(); !isReady {
			t.Error("the step is not ready after it succeeded")
		}
	})
}

// Retry gives up when ctx ends, while it waits between attempts and while
// an attempt is in flight, and the step stays not ready.
func TestRetryGivesUpWhenStopped(t *testing.T) {
	for _, during := range []string{"backoff", "attempt"} {
		t.Run(during, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ready := obs.NewReadiness("nats_streams")
				ctx, cancel := context.WithCancel(t.Context())
				time.AfterFunc(time.Second, cancel)
				start := time.Now()
				_, ok := Retry(ctx, discard, ready, "nats_streams", func(ctx context.Context) (string, error) {
					if during == "attempt" {
						<-ctx.Done()
						return "", ctx.Err()
					}
					return "", errors.New("no responders")
				})
				if ok {
					t.Fatal("Retry = true after ctx ended")
				}
				if d := time.Since(start); d != time.Second {
					t.Errorf("Retry returned after %v, want at once when ctx ended (1s)", d)
				}
				if _, isReady := ready.Check(); isReady {
					t.Error("the step is ready though it never succeeded")
				}
			})
		})
	}
}

// Each attempt has a deadline, so one that hangs is retried.
func TestRetryBoundsEachAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ready := obs.NewReadiness("postgres")
		n := 0
		_, ok := Retry(t.Context(), discard, ready, "postgres", func(ctx context.Context) (int, error) {
			if n++; n == 1 {
				<-ctx.Done() // a server that accepts and never answers
				return 0, ctx.Err()
			}
			return 1, nil
		})
		if !ok || n != 2 {
			t.Errorf("Retry = %v after %d attempts, want true after 2", ok, n)
		}
	})
}
