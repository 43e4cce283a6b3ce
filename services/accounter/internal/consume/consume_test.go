package consume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

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
		{"script error", fmt.Errorf("settle: %w", scriptError("ERR user_script:1: bad argument")), false},
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
