package events

import (
	"fmt"
	"time"
)

// MaxSkew is how far after its first storage an event's time may lie: the
// clocks of producers and servers differ by a little, never by this much.
const MaxSkew = time.Minute

// CheckTime reports, as an error wrapping ErrInvalid, an event time t that
// lies more than maxAge before stored (older than the stream keeps events:
// charging it would move windows that reconciliation sets back) or more
// than MaxSkew after it. stored is when the event was first stored.
func CheckTime(t, stored time.Time, maxAge time.Duration) error {
	switch {
	case t.Before(stored.Add(-maxAge)):
		return fmt.Errorf("%w: time: %s is more than %s before the event was first stored (%s)",
			ErrInvalid, t.Format(time.RFC3339), maxAge, stored.UTC().Format(time.RFC3339))
	case t.After(stored.Add(MaxSkew)):
		return fmt.Errorf("%w: time: %s is more than %s after the event was first stored (%s)",
			ErrInvalid, t.Format(time.RFC3339), MaxSkew, stored.UTC().Format(time.RFC3339))
	}
	return nil
}
