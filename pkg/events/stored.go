package events

import (
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// HeaderFirstStored holds when a message's event was first stored (RFC
// 3339 with nanoseconds), where that was before the stream stored this
// message: DeadLetter keeps the original's time, so a replayed event is
// judged as it was, and a Publisher made WithOwnTime (admission's outbox,
// which keeps events in memory and on disk while NATS is away) stamps each
// event with its own time.
const HeaderFirstStored = "Quotaflow-First-Stored"

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

// FirstStored is when msg's event was first stored: its HeaderFirstStored,
// else when the stream stored msg; zero when neither is known.
func FirstStored(msg jetstream.Msg) time.Time {
	if h := msg.Headers().Get(HeaderFirstStored); h != "" {
		if t, err := time.Parse(time.RFC3339Nano, h); err == nil {
			return t
		}
	}
	if md, err := msg.Metadata(); err == nil {
		return md.Timestamp
	}
	return time.Time{}
}

// DecodeMsg decodes msg's event (Decode) and checks its time against its
// first storage (CheckTime, with cfg's MaxAge): what a consumer of the
// usage stream accepts. Its errors wrap ErrInvalid: dead-letter the
// message, retrying cannot help.
func DecodeMsg(msg jetstream.Msg, cfg Config) (Event, error) {
	ev, err := Decode(msg.Data())
	if err != nil {
		return Event{}, err
	}
	if stored := FirstStored(msg); !stored.IsZero() {
		if err := CheckTime(ev.Time, stored, cfg.withDefaults().MaxAge); err != nil {
			return Event{}, err
		}
	}
	return ev, nil
}
