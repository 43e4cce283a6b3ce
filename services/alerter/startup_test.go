package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/e2e"
)

// proxy forwards the TCP connections accepted on l to target until l is
// closed.
func proxy(t *testing.T, l net.Listener, target string) {
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				s, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer s.Close()
				go func() { _, _ = io.Copy(s, c); s.Close() }()
				_, _ = io.Copy(c, s)
			})
		}
	})
}

// TestStartsWhenPostgresComesLate starts the alerter while nothing listens
// at its Postgres address: it must keep retrying, with /readyz 503 saying
// it waits for Postgres, and become ready once Postgres answers there.
func TestStartsWhenPostgresComesLate(t *testing.T) {
	e := newEnv(t, opsHook)
	real, err := url.Parse(e.cfg.PostgresURL)
	if err != nil {
		t.Fatal(err)
	}
	late, err := e2e.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	u := *real
	u.Host = late
	q := u.Query()
	q.Set("connect_timeout", "2")
	u.RawQuery = q.Encode()
	e.cfg.PostgresURL = u.String()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opsc := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, e.cfg, slog.New(slog.DiscardHandler), hooks{started: func(ops string) { opsc <- ops }})
	}()
	var ops string
	select {
	case ops = <-opsc:
	case err := <-done:
		t.Fatalf("run returned %v before serving /readyz", err)
	}

	e2e.Eventually(e.t, "readyz waiting for postgres", func() bool {
		code, body := e2e.Readyz(ops)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "waiting for postgres")
	})
	// It keeps retrying (several backoff rounds) instead of exiting.
	select {
	case err := <-done:
		t.Fatalf("run exited while Postgres was down: %v", err)
	case <-time.After(700 * time.Millisecond):
	}
	if code, body := e2e.Readyz(ops); code != http.StatusServiceUnavailable || !strings.Contains(body, "waiting for postgres") {
		t.Fatalf("readyz = %d %s, want 503 waiting for postgres", code, body)
	}

	// Postgres comes up at that address: the alerter gets ready.
	l, err := net.Listen("tcp", late)
	if err != nil {
		t.Fatalf("listen on %s: %v", late, err)
	}
	proxy(t, l, real.Host)
	e2e.Eventually(e.t, "ready once postgres answers", func() bool {
		code, _ := e2e.Readyz(ops)
		return code == http.StatusOK
	})

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("run did not return after cancel")
	}
}

// TestStopsWhilePostgresDown checks a shutdown while Postgres never came up
// is clean.
func TestStopsWhilePostgresDown(t *testing.T) {
	e := newEnv(t, opsHook)
	down, err := e2e.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	e.cfg.PostgresURL = "postgres://postgres@" + down + "/x?sslmode=disable&connect_timeout=2"
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	opsc := make(chan string, 1)
	go func() {
		done <- run(ctx, e.cfg, slog.New(slog.DiscardHandler), hooks{started: func(ops string) { opsc <- ops }})
	}()
	ops := <-opsc
	e2e.Eventually(e.t, "readyz waiting for postgres", func() bool {
		_, body := e2e.Readyz(ops)
		return strings.Contains(body, "waiting for postgres")
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after cancel")
	}
}
