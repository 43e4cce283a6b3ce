package consume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/effects"
)

// scriptError is a Redis error reply, as go-redis returns it.
type scriptError string

func (e scriptError) Error() string { return string(e) }
func (scriptError) RedisError()     {}

var _ redis.Error = scriptError("")

func TestTransient(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"no epoch", fmt.Errorf("settle: %w", limits.ErrNoEpoch), true},
		{"connection lost", fmt.Errorf("settle: %w", io.EOF), true},
		{"deadline", context.DeadlineExceeded, true},
		{"loading", fmt.Errorf("settle: %w", scriptError("LOADING Redis is loading the dataset in memory")), true},
		// Refusals to write: Redis's condition, not the event's.
		{"out of memory", fmt.Errorf("settle: %w", scriptError("OOM command not allowed when used memory > 'maxmemory'.")), true},
		{"failed snapshot", fmt.Errorf("settle: %w", scriptError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.")), true},
		{"no replicas", fmt.Errorf("settle: %w", scriptError("NOREPLICAS Not enough good replicas to write.")), true},
		{"acl", fmt.Errorf("settle: %w", scriptError("NOPERM User default has no permissions to run the 'fcall' command")), true},
		// The scripts take only arguments the engine checked (ErrInvalid):
		// an error of theirs is a state they cannot read, or a bug.
		{"script error", fmt.Errorf("settle: %w", scriptError("settle: WRONGTYPE Operation against a key holding the wrong kind of value")), true},
		{"invalid argument", fmt.Errorf("settle: %w", limits.ErrInvalid), false},
		{"policy", fmt.Errorf("%w of t: %w", effects.ErrResolve, errors.New("unknown plan")), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := transient(tc.err); got != tc.want {
				t.Errorf("transient(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

// storedMsg is a message stored at a time.
type storedMsg struct {
	jetstream.Msg
	at time.Time
}

func (m storedMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Timestamp: m.at}, nil
}

func TestRecentIsTheLastStretch(t *testing.T) {
	t0 := time.Now()
	var ds []*stream.Delivery
	for _, ms := range []int{0, 10, 40, 45, 60, 95} {
		ds = append(ds, &stream.Delivery{Msg: storedMsg{at: t0.Add(time.Duration(ms) * time.Millisecond)}})
	}
	for _, tc := range []struct {
		window time.Duration
		want   int
	}{
		{50 * time.Millisecond, 4}, // 60 and 95: 45 is 50 ms before the last
		{time.Millisecond, 5},      // the last alone
		{time.Second, 0},           // all
	} {
		if got := recent(ds, tc.window); got != tc.want {
			t.Errorf("recent(window %v) = %d, want %d", tc.window, got, tc.want)
		}
	}
}

// TestQueueHoldsAMessageOnce plays two fetches of reports whose reserved
// events have not come: the last 50 ms of the first are held for the
// second, and kept there even where holding them again would part fewer
// requests.
func TestQueueHoldsAMessageOnce(t *testing.T) {
	c := &Consumer{opts: Options{BatchSize: 100, BatchWait: 200 * time.Millisecond},
		pending: stream.NewPending(stream.Config{AckWait: time.Hour})}
	t0 := time.Now()
	msg := func(ms int, req string) *stream.Delivery {
		return &stream.Delivery{Msg: storedMsg{at: t0.Add(time.Duration(ms) * time.Millisecond)},
			Events: []events.Event{{Data: events.Actual{Tenant: "t", User: "u", RequestID: req}}}}
	}
	taken := func() (ids []string) {
		for run, ok := c.pending.Next(); ok; run, ok = c.pending.Next() {
			for _, d := range run {
				ids = append(ids, d.Events[0].Data.(events.Actual).RequestID)
			}
		}
		return ids
	}
	first := []*stream.Delivery{msg(0, "a"), msg(60, "x"), msg(70, "y")}
	c.queue(first, 0, t0)
	if got := taken(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("first fetch queued %v, want [a] (x and y held)", got)
	}
	held, _ := c.pending.TakeHeld()
	c.queue(append(held, msg(80, "z")), len(held), t0)
	if got := taken(); !slices.Equal(got, []string{"x", "y"}) {
		t.Errorf("second fetch queued %v, want [x y] (held before, z held now)", got)
	}
	if held, _ := c.pending.TakeHeld(); len(held) != 1 || held[0].Events[0].Data.(events.Actual).RequestID != "z" {
		t.Errorf("held %d messages, want z alone", len(held))
	}
}
