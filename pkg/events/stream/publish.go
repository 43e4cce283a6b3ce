package stream

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// Headers of a dead letter, beside the original payload.
const (
	// HeaderError holds why the message was dead-lettered (one line, at
	// most maxHeaderError bytes).
	HeaderError = "Quotaflow-Error"
	// HeaderSubject is the subject the message was published on: replay
	// republishes the payload there.
	HeaderSubject = "Quotaflow-Original-Subject"
	// HeaderStream and HeaderSequence locate the message in its stream.
	HeaderStream   = "Quotaflow-Original-Stream"
	HeaderSequence = "Quotaflow-Original-Sequence"
	// HeaderMsgID is the original Nats-Msg-Id, if any.
	HeaderMsgID = "Quotaflow-Original-Msg-Id"
	// HeaderDelivered is how many times the consumer had received it.
	HeaderDelivered = "Quotaflow-Delivered"
)

// Dead-letter reasons used by Process; each is the last token of the
// dead-letter subject.
const (
	ReasonInvalid    = "invalid"     // DecodeMsg rejected the event
	ReasonMaxDeliver = "max_deliver" // the handler failed MaxDeliver times
)

// publishTimeout bounds a publish whose context has no deadline, as the
// jetstream package does for its own requests.
const publishTimeout = 5 * time.Second

// maxHeaderError caps the error text in a dead letter's header.
const maxHeaderError = 1024

// Publisher publishes events to the usage stream, each with Nats-Msg-Id set
// to the event id, so a retried publish of the same event is stored once.
// It validates every event first (events.Encode): consumers never see an
// event the contract rejects. Publish is the call most callers want;
// PublishBatch sends many at once. A Publisher is safe for concurrent use.
type Publisher struct {
	js      jetstream.Publisher
	prefix  string
	stream  string
	ownTime bool
}

// PublisherOption configures a Publisher.
type PublisherOption func(*Publisher)

// WithOwnTime makes the Publisher stamp every event with its own time as
// its first storage (HeaderFirstStored), so consumers judge the event's
// time against itself rather than against when the stream stored it: for a
// publisher that stores events before the stream does and may publish them
// long after (admission's outbox and spill) and has checked their times
// itself.
func WithOwnTime() PublisherOption { return func(p *Publisher) { p.ownTime = true } }

// NewPublisher returns a Publisher on js for the stream and subject prefix
// of cfg (zero fields take their defaults). Every publish expects cfg's
// stream, so a misrouted prefix fails instead of landing elsewhere.
func NewPublisher(js jetstream.Publisher, cfg Config, opts ...PublisherOption) *Publisher {
	cfg = cfg.WithDefaults()
	p := &Publisher{js: js, prefix: cfg.SubjectPrefix, stream: cfg.Stream}
	for _, o := range opts {
		o(p)
	}
	return p
}

func (p *Publisher) msg(ev events.Event) (*nats.Msg, error) {
	b, err := events.Encode(ev)
	if err != nil {
		return nil, err
	}
	m := nats.NewMsg(events.Subject(p.prefix, ev.Type()))
	m.Data = b
	m.Header.Set("Content-Type", events.ContentType)
	if p.ownTime {
		m.Header.Set(HeaderFirstStored, ev.Time.UTC().Format(time.RFC3339Nano))
	}
	return m, nil
}

func (p *Publisher) opts(ev events.Event) []jetstream.PublishOpt {
	return []jetstream.PublishOpt{jetstream.WithMsgID(ev.ID), jetstream.WithExpectStream(p.stream)}
}

// Publish sends ev and waits until the stream has stored it (or already
// had it: a duplicate is success). Errors other than events.ErrInvalid may
// be retried with the same event.
func (p *Publisher) Publish(ctx context.Context, ev events.Event) error {
	m, err := p.msg(ev)
	if err != nil {
		return err
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if _, err := p.js.PublishMsg(ctx, m, p.opts(ev)...); err != nil {
		return fmt.Errorf("publish %s %s: %w", ev.Type(), ev.ID, err)
	}
	return nil
}

// PublishAsync sends ev without waiting; the future reports the stream's
// ack. The jetstream context bounds how many may be pending
// (jetstream.WithPublishAsyncMaxPending). Wait for them with the futures,
// PublishBatch or Flush.
func (p *Publisher) PublishAsync(ev events.Event) (jetstream.PubAckFuture, error) {
	m, err := p.msg(ev)
	if err != nil {
		return nil, err
	}
	f, err := p.js.PublishMsgAsync(m, p.opts(ev)...)
	if err != nil {
		return nil, fmt.Errorf("publish %s %s: %w", ev.Type(), ev.ID, err)
	}
	return f, nil
}

// PublishBatch sends evs asynchronously and waits for every ack, until ctx
// ends (5 s when ctx has no deadline). It returns nil when all were stored,
// else a *BatchError saying which failed; retrying those (or the whole
// batch: ids dedup) is safe.
func (p *Publisher) PublishBatch(ctx context.Context, evs []events.Event) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	errs := make([]error, len(evs))
	futures := make([]jetstream.PubAckFuture, len(evs))
	for i, ev := range evs {
		futures[i], errs[i] = p.PublishAsync(ev)
	}
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			errs[i] = fmt.Errorf("publish %s %s: %w", evs[i].Type(), evs[i].ID, err)
		case <-ctx.Done():
			errs[i] = fmt.Errorf("publish %s %s: %w", evs[i].Type(), evs[i].ID, ctx.Err())
		}
	}
	for _, err := range errs {
		if err != nil {
			return &BatchError{Errs: errs}
		}
	}
	return nil
}

// Flush waits until every asynchronous publish of the underlying jetstream
// context has been acknowledged or has failed, or ctx ends. Services call
// it on shutdown.
func (p *Publisher) Flush(ctx context.Context) error {
	select {
	case <-p.js.PublishAsyncComplete():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("flush %d pending publishes: %w", p.js.PublishAsyncPending(), ctx.Err())
	}
}

// BatchError is PublishBatch's error: Errs[i] is the error of the batch's
// event i, nil for the events that were stored.
type BatchError struct {
	Errs []error // one per event of the batch, in order; nil = stored
}

// Error summarises the failures.
func (e *BatchError) Error() string {
	n := 0
	var first error
	for _, err := range e.Errs {
		if err != nil {
			if first == nil {
				first = err
			}
			n++
		}
	}
	return fmt.Sprintf("publish batch: %d of %d events failed, first: %v", n, len(e.Errs), first)
}

// Unwrap returns the non-nil errors, for errors.Is and errors.As.
func (e *BatchError) Unwrap() []error {
	var out []error
	for _, err := range e.Errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

// DeadLetter publishes msg's payload unchanged to
// events.DLQSubject(cfg.SubjectPrefix, reason) in the dead-letter stream, with headers saying why (HeaderError,
// from cause) and where it came from (HeaderSubject, HeaderStream,
// HeaderSequence, HeaderMsgID, HeaderDelivered). Its Nats-Msg-Id derives
// from the original stream and sequence, so dead-lettering the same message
// twice (a crash before its Term) stores it once. Original headers other
// than Nats-* ones are kept.
func DeadLetter(ctx context.Context, js jetstream.Publisher, cfg Config, reason string, msg jetstream.Msg, cause error) error {
	dl := nats.NewMsg(events.DLQSubject(cfg.WithDefaults().SubjectPrefix, reason))
	dl.Data = msg.Data()
	for k, v := range msg.Headers() {
		if !strings.HasPrefix(strings.ToLower(k), "nats-") {
			dl.Header[k] = v
		}
	}
	errText := "unknown error"
	if cause != nil {
		errText = headerValue(cause.Error())
	}
	dl.Header.Set(HeaderError, errText)
	dl.Header.Set(HeaderSubject, msg.Subject())
	if id := msg.Headers().Get(jetstream.MsgIDHeader); id != "" {
		dl.Header.Set(HeaderMsgID, headerValue(id))
	}
	var opts []jetstream.PublishOpt
	if md, err := msg.Metadata(); err == nil {
		if dl.Header.Get(HeaderFirstStored) == "" {
			// A replay is judged by when the event was first stored.
			dl.Header.Set(HeaderFirstStored, md.Timestamp.UTC().Format(time.RFC3339Nano))
		}
		seq := strconv.FormatUint(md.Sequence.Stream, 10)
		dl.Header.Set(HeaderStream, md.Stream)
		dl.Header.Set(HeaderSequence, seq)
		dl.Header.Set(HeaderDelivered, strconv.FormatUint(md.NumDelivered, 10))
		opts = append(opts, jetstream.WithMsgID("dlq."+md.Stream+"."+seq))
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if _, err := js.PublishMsg(ctx, dl, opts...); err != nil {
		return fmt.Errorf("dead-letter %s to %s: %w", msg.Subject(), dl.Subject, err)
	}
	return nil
}

// headerValue makes s a safe one-line header value of at most
// maxHeaderError bytes.
func headerValue(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(s, "\uFFFD"))
	if len(s) > maxHeaderError {
		i := maxHeaderError
		for i > 0 && !utf8.RuneStart(s[i]) {
			i--
		}
		s = s[:i]
	}
	return s
}

func withDefaultTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, publishTimeout)
}
