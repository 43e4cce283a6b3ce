package e2e

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// Pipeline names where a run's events wait on their way to the ledger:
// admission's outbox, the stream the accounter's durable consumer reads,
// the dead-letter stream of the events it gave up on, and the ledger.
type Pipeline struct {
	AdmissionOps []string // every admission instance's ops base URL (its /metrics)
	NATSURL      string
	Stream       string
	Durable      string // the accounter's durable consumer on Stream
	DLQ          string
	DBURL        string
	// MayLoseReserved is how many reserved events may be missing from the
	// ledger without counting as a loss: those an admission instance
	// killed with SIGKILL may have held in its memory queue (the chaos
	// run's cluster mode bounds and checks them itself).
	MayLoseReserved int64
}

// Backlog is what a Pipeline still holds before the ledger.
type Backlog struct {
	Outbox     int64  // events in the admission instances' outboxes (queued or in flight)
	Spilled    int64  // bytes of events in their spill directories
	Unconsumed uint64 // messages on Stream not yet delivered to the accounter
	AckPending int    // messages delivered to the accounter, not yet acknowledged
}

// Empty reports whether nothing is left before the ledger: the accounter
// acknowledges a message once its effects are committed.
func (b Backlog) Empty() bool {
	return b.Outbox == 0 && b.Spilled == 0 && b.Unconsumed == 0 && b.AckPending == 0
}

func (b Backlog) String() string {
	return fmt.Sprintf("outbox pending %d (spilled %d bytes), stream unconsumed %d (ack-pending %d)",
		b.Outbox, b.Spilled, b.Unconsumed, b.AckPending)
}

// Backlog reads the admission instances' outbox gauges and the accounter's consumer.
func (p Pipeline) Backlog(ctx context.Context, js jetstream.JetStream) (Backlog, error) {
	var b Backlog
	for _, ops := range p.AdmissionOps {
		samples, err := Scrape(ctx, ops)
		if err != nil {
			return b, fmt.Errorf("admission metrics: %w", err)
		}
		found := 0
		for _, s := range samples {
			switch s.Name {
			case "quotaflow_admission_outbox_queue_depth":
				b.Outbox, found = b.Outbox+int64(s.Value), found+1
			case "quotaflow_admission_outbox_spill_bytes":
				b.Spilled, found = b.Spilled+int64(s.Value), found+1
			}
		}
		if found != 2 {
			return b, fmt.Errorf("admission metrics at %s lack the outbox's queue depth or spill bytes", ops)
		}
	}
	c, err := js.Consumer(ctx, p.Stream, p.Durable)
	if err != nil {
		return b, fmt.Errorf("consumer %s on %s: %w", p.Durable, p.Stream, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return b, fmt.Errorf("consumer %s on %s: %w", p.Durable, p.Stream, err)
	}
	b.Unconsumed, b.AckPending = info.NumPending, info.NumAckPending
	return b, nil
}
