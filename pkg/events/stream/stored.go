package stream

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// HeaderFirstStored holds when a message's event was first stored (RFC
// 3339 with nanoseconds), where that was before the stream stored this
// message: DeadLetter keeps the original's time, so a replayed event is
// judged as it was, and a Publisher made WithOwnTime (admission's outbox,
// which keeps events in memory and on disk while NATS is away) stamps each
// event with its own time.
const HeaderFirstStored = "Quotaflow-First-Stored"

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

// DecodeMsg decodes msg's event (events.Decode) and checks its time
// against its first storage (events.CheckTime, with cfg's MaxAge): what a
// consumer of the usage stream accepts. Its errors wrap events.ErrInvalid:
// dead-letter the message, retrying cannot help.
func DecodeMsg(msg jetstream.Msg, cfg Config) (events.Event, error) {
	ev, err := events.Decode(msg.Data())
	if err != nil {
		return events.Event{}, err
	}
	if stored := FirstStored(msg); !stored.IsZero() {
		if err := events.CheckTime(ev.Time, stored, cfg.WithDefaults().MaxAge); err != nil {
			return events.Event{}, err
		}
	}
	return ev, nil
}
