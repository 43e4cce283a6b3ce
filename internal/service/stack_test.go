package service

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/obs"
)

// recorder is a stack whose stops append their names to order.
type recorder struct {
	*Stack
	order []string
	logs  *bytes.Buffer
}

func newRecorder(timeout time.Duration) *recorder {
	var logs bytes.Buffer
	return &recorder{Stack: NewStack(slog.New(slog.NewTextHandler(&logs, nil)), timeout, obs.NewReadiness()), logs: &logs}
}

func (r *recorder) push(name string, err error) {
	r.Push(name, func(context.Context) error {
		r.order = append(r.order, name)
		return err
	})
}

func TestStackStopsInReverseOrder(t *testing.T) {
	r := newRecorder(time.Second)
	r.push("ops server", nil)
	r.Push("api server", func(context.Context) error {
		if st, _ := r.ready.Check(); st.Status != "draining" {
			t.Errorf("readyz %q while the first stop runs, want draining", st.Status)
		}
		return nil
	})
	r.push("redis", nil)
	r.push("nats", nil)
	r.push("api server", nil)
	r.Close()
	if want := []string{"api server", "nats", "redis", "ops server"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
	if !strings.Contains(r.logs.String(), "msg=stopped") {
		t.Errorf("logs = %q, want a stopped line", r.logs.String())
	}
	r.order = nil
	r.Close()
	if len(r.order) != 0 {
		t.Errorf("a second Close ran %v again", r.order)
	}
}

// A run that fails part-way stops what it had started, in reverse, and
// nothing it had not.
func TestStackStopsWhatStartedWhenRunFails(t *testing.T) {
	r := newRecorder(time.Second)
	run := func() error {
		defer r.Close()
		r.push("ops server", nil)
		r.push("postgres", nil)
		if err := errors.New("nats: no servers"); err != nil {
			return err
		}
		r.push("nats", nil)
		return nil
	}
	if err := run(); err == nil {
		t.Fatal("run = nil, want its error")
	}
	if want := []string{"postgres", "ops server"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
}

// A failed or slow stop is logged and the ones after it still run, each
// under a deadline of its own.
func TestStackGoesOnAfterAFailedStop(t *testing.T) {
	r := newRecorder(50 * time.Millisecond)
	r.Push("postgres", func(ctx context.Context) error {
		if dl, ok := ctx.Deadline(); !ok || time.Until(dl) < 40*time.Millisecond {
			t.Errorf("postgres's stop got deadline %v (set %v), want its own 50ms", dl, ok)
		}
		r.order = append(r.order, "postgres")
		return nil
	})
	r.Push("outbox", func(ctx context.Context) error {
		<-ctx.Done() // a flush that does not finish in time
		r.order = append(r.order, "outbox")
		return ctx.Err()
	})
	r.push("decider", errors.New("leases not returned"))
	r.Close()
	if want := []string{"decider", "outbox", "postgres"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
	for _, want := range []string{"step=decider err=\"leases not returned\"", "step=outbox err=\"context deadline exceeded\""} {
		if !strings.Contains(r.logs.String(), want) {
			t.Errorf("logs lack %s: %s", want, r.logs.String())
		}
	}
}

// A goroutine started with Go runs until its turn: what was pushed after
// it stops first, while it still runs; then it is cancelled and waited for.
func TestStackGoStopsInItsTurn(t *testing.T) {
	r := newRecorder(time.Second)
	r.push("redis", nil)
	running := make(chan context.Context)
	r.Go("eviction", func(ctx context.Context) {
		running <- ctx
		<-ctx.Done()
		time.Sleep(10 * time.Millisecond) // Close must wait for this
		r.order = append(r.order, "eviction")
	})
	evictionCtx := <-running
	r.Push("api server", func(context.Context) error {
		if evictionCtx.Err() != nil {
			t.Error("the goroutine was cancelled before what started after it stopped")
		}
		r.order = append(r.order, "api server")
		return nil
	})
	r.Close()
	if want := []string{"api server", "eviction", "redis"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
}

// A goroutine that ignores its context holds its step only until the
// step's deadline: the stops after it still run, and the failure is logged.
func TestStackGoGivesUpAtItsDeadline(t *testing.T) {
	r := newRecorder(50 * time.Millisecond)
	r.push("nats", nil)
	stuck := make(chan struct{})
	defer close(stuck)
	r.Go("rebuild", func(context.Context) { <-stuck })
	r.Close()
	if want := []string{"nats"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
	if want := `step=rebuild err="rebuild still running: context deadline exceeded"`; !strings.Contains(r.logs.String(), want) {
		t.Errorf("logs lack %s: %s", want, r.logs.String())
	}
}

// A stop that panics does not skip the ones after it: the outbox is still
// flushed and NATS still drained; Close panics afterwards with its value.
func TestStackGoesOnAfterAPanickingStop(t *testing.T) {
	r := newRecorder(time.Second)
	r.push("nats", nil)
	r.push("outbox", nil)
	r.Push("decider", func(context.Context) error {
		r.order = append(r.order, "decider")
		panic("lease pool corrupted")
	})
	r.push("api server", nil)
	var got any
	func() {
		defer func() { got = recover() }()
		r.Close()
	}()
	if want := []string{"api server", "decider", "outbox", "nats"}; !slices.Equal(r.order, want) {
		t.Errorf("Close ran %v, want %v", r.order, want)
	}
	err, ok := got.(error)
	if !ok || !strings.Contains(err.Error(), "decider") || !strings.Contains(err.Error(), "lease pool corrupted") {
		t.Errorf("Close panicked with %v, want the decider's panic", got)
	}
	for _, want := range []string{"shutdown step panicked", "step=decider", "msg=stopped"} {
		if !strings.Contains(r.logs.String(), want) {
			t.Errorf("logs lack %s: %s", want, r.logs.String())
		}
	}
}
