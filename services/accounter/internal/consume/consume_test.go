package consume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/redis/go-redis/v9"

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
