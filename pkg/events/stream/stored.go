package stream

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// HeaderFirstStored holds when a message's event was first stored (RFC
// 3339 with nanoseconds), where that was before the stream stored this
// message: DeadLetter keeps the original's time, so a replayed event is
// judged as it was, and a Publisher made WithOwnTime (admission's outbox,
// which keeps events in memory and on disk while NATS is away) stamps each
// event with its own time. A time after the stream stored the message is
// not believed: consumers take the stream's (FirstStored).
const HeaderFirstStored = "Quotaflow-First-Stored"

// FirstStoredOwn, as the HeaderFirstStored of a batch, says that each of
// its events was first stored at its own time (a Publisher made
// WithOwnTime), or when the stream stored the batch if that was earlier.
const FirstStoredOwn = "own"

// FirstStored is when msg's event was first stored: its HeaderFirstStored,
// but no later than when the stream stored msg, else when the stream
// stored msg; zero when neither is known.
func FirstStored(msg jetstream.Msg) time.Time {
	var stored time.Time
	if md, err := msg.Metadata(); err == nil {
		stored = md.Timestamp
	}
	if h := msg.Headers().Get(HeaderFirstStored); h != "" {
		if t, err := time.Parse(time.RFC3339Nano, h); err == nil {
			return earliest(t, stored)
		}
	}
	return stored
}

// earliest is claimed, a first-stored time a publisher gave, or stored,
// when the stream stored the message, if that is earlier (or claimed when
// stored is unknown): a publisher can store an event before the stream
// does, never after, so a clock ahead cannot carry an event's time past
// the time rule (events.CheckTime) nor date its usage in the future.
func earliest(claimed, stored time.Time) time.Time {
	if stored.IsZero() || claimed.Before(stored) {
		return claimed
	}
	return stored
}
