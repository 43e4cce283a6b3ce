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
// event with its own time.
const HeaderFirstStored = "Quotaflow-First-Stored"

// FirstStoredOwn, as the HeaderFirstStored of a batch, says that each of
// its events was first stored at its own time (a Publisher made
// WithOwnTime).
const FirstStoredOwn = "own"

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
