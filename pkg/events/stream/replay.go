package stream

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// Replay republishes the dead letters of cfg's dead-letter stream whose
// reason is reason (every reason when empty) to the subjects they came
// from, then deletes them from the dead-letter stream: run it once the
// cause is fixed (a policy that lacked a plan, a consumer bug). It returns
// how many it replayed.
//
// A replayed event gets a new Nats-Msg-Id ("replay.<dead-letter seq>"):
// the original id is still in the usage stream's duplicate window and
// would be dropped as a duplicate. Consumers are idempotent by the
// CloudEvent id in the payload, so an event that reaches them twice (a
// replay retried after a crash between publish and delete) counts once.
func Replay(ctx context.Context, js jetstream.JetStream, cfg Config, reason string) (int, error) {
	cfg = cfg.WithDefaults()
	stream, err := js.Stream(ctx, cfg.DLQStream)
	if err != nil {
		return 0, fmt.Errorf("replay: dead-letter stream %s: %w", cfg.DLQStream, err)
	}
	filter := events.DLQSubjects(cfg.SubjectPrefix)
	if reason != "" {
		filter = events.DLQSubject(cfg.SubjectPrefix, reason)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	last := info.State.LastSeq // letters dead-lettered during the replay wait for the next one
	n := 0
	for seq := info.State.FirstSeq; seq != 0 && seq <= last; {
		m, err := stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(filter))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break // nothing more on the filter
		}
		if err != nil {
			return n, fmt.Errorf("replay: read dead letter %d: %w", seq, err)
		}
		if m.Sequence > last {
			break
		}
		orig := m.Header.Get(HeaderSubject)
		if orig == "" {
			return n, fmt.Errorf("replay: dead letter %d has no %s header", m.Sequence, HeaderSubject)
		}
		out := nats.NewMsg(orig)
		out.Data = m.Data
		for k, v := range m.Header {
			switch k {
			case HeaderError, HeaderSubject, HeaderStream, HeaderSequence, HeaderMsgID, HeaderDelivered, HeaderBatchIndex:
			default:
				out.Header[k] = v
			}
		}
		id := "replay." + strconv.FormatUint(m.Sequence, 10)
		if _, err := js.PublishMsg(ctx, out, jetstream.WithMsgID(id)); err != nil {
			return n, fmt.Errorf("replay: publish dead letter %d to %s: %w", m.Sequence, orig, err)
		}
		if err := stream.DeleteMsg(ctx, m.Sequence); err != nil {
			return n, fmt.Errorf("replay: delete dead letter %d: %w", m.Sequence, err)
		}
		n++
		seq = m.Sequence + 1
	}
	return n, nil
}
