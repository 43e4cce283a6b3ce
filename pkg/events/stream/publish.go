package stream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/klauspost/compress/s2"
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
// PublishBatch sends many at once, packed into batch messages. A Publisher
// is safe for concurrent use.
type Publisher struct {
	js      jetstream.Publisher
	prefix  string
	stream  string
	ownTime bool
	plain   bool // batches go uncompressed (Config.Compression, WithCompression(false))
	// budget is the most bytes of events one message carries: what fits
	// the server's max payload (ceiling), lowered to the stream's
	// MaxMsgSize once the stream refuses a message for its size, and
	// raised again when the stream takes more (fitStream).
	budget  atomic.Int64
	ceiling int64
	// fitted counts the rounds sent whole under a lowered budget: every
	// refitAfter-th reads the stream's limit again.
	fitted atomic.Int64
	// encoded keeps a buffer that PublishBatch builds a message's events
	// in between rounds, compressed one the compression writes into.
	encoded, compressed spare
}

// refitAfter is how many rounds a Publisher sends whole under a lowered
// budget before it reads the stream's MaxMsgSize again, to learn that a
// newer service's Ensure raised it once a rolling upgrade ends: one small
// JetStream API request per 1000 rounds, and no message is refused to
// find out (a blind raise would be).
const refitAfter = 1000

// PublisherOption configures a Publisher.
type PublisherOption func(*Publisher)

// WithOwnTime makes the Publisher stamp every event with its own time as
// its first storage (HeaderFirstStored), so consumers judge the event's
// time against itself rather than against when the stream stored it, when
// that is later (FirstStored): for a publisher that stores events before
// the stream does and may publish them long after (admission's outbox and
// spill) and has checked their times itself. A single event's header holds its time; a batch's holds
// FirstStoredOwn, which means the same for each of its events.
func WithOwnTime() PublisherOption { return func(p *Publisher) { p.ownTime = true } }

// WithCompression sets whether PublishBatch compresses its batch messages
// (EncodingS2, HeaderContentEncoding) or sends their JSON as it is: for a
// stream whose consumers predate compression, which take a compressed
// batch for invalid. It overrides Config.Compression (QF_EVENT_COMPRESSION,
// which services set). A single event is never compressed.
func WithCompression(on bool) PublisherOption { return func(p *Publisher) { p.plain = !on } }

// WithMaxPayload sets the largest message the server accepts, headers
// included: pass the connection's nats.Conn.MaxPayload(). PublishBatch
// packs events into messages that fit it (and events.MaxBatchSize). Without
// it a Publisher assumes DefaultMaxPayload, which every server configured
// for single events accepts. The stream may take less (an older service's
// Ensure sets its MaxMsgSize to DefaultMaxPayload): PublishBatch then
// learns the stream's limit from its refusal.
func WithMaxPayload(n int64) PublisherOption {
	return func(p *Publisher) {
		if n > 0 {
			p.ceiling = int64(budget(n))
		}
	}
}

// DefaultMaxPayload is the message size a Publisher assumes without
// WithMaxPayload: the largest valid event and its headers, which a usage
// stream of any version of this package stores.
const DefaultMaxPayload = events.MaxEventSize + headerRoom

// headerRoom is what a message's headers may take beside its payload:
// Nats-Msg-Id (a batch id is 38 bytes), Nats-Expected-Stream, Content-Type
// and HeaderFirstStored are under 300 bytes together.
const headerRoom = 4 << 10

// budget is the payload of events that fits a message of maxPayload bytes.
func budget(maxPayload int64) int {
	return int(min(maxPayload-headerRoom, events.MaxBatchSize, 1<<30))
}

// NewPublisher returns a Publisher on js for the stream, subject prefix and
// compression of cfg (zero fields take their defaults). Every publish
// expects cfg's stream, so a misrouted prefix fails instead of landing
// elsewhere.
func NewPublisher(js jetstream.Publisher, cfg Config, opts ...PublisherOption) *Publisher {
	cfg = cfg.WithDefaults()
	p := &Publisher{js: js, prefix: cfg.SubjectPrefix, stream: cfg.Stream, plain: cfg.Compression == CompressionNone}
	p.ceiling = int64(budget(DefaultMaxPayload))
	for _, o := range opts {
		o(p)
	}
	p.budget.Store(p.ceiling)
	return p
}

// single is the message of one encoded event: a plain CloudEvent, as
// consumers of every version read it.
func (p *Publisher) single(ev events.Event, b []byte) *nats.Msg {
	m := nats.NewMsg(events.Subject(p.prefix, ev.Type()))
	m.Data = b
	m.Header.Set("Content-Type", events.ContentType)
	if p.ownTime {
		m.Header.Set(HeaderFirstStored, ev.Time.UTC().Format(time.RFC3339Nano))
	}
	return m
}

func (p *Publisher) msg(ev events.Event) (*nats.Msg, error) {
	b, err := events.Encode(ev)
	if err != nil {
		return nil, err
	}
	return p.single(ev, b), nil
}

func (p *Publisher) opts(id string) []jetstream.PublishOpt {
	return []jetstream.PublishOpt{jetstream.WithMsgID(id), jetstream.WithExpectStream(p.stream)}
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
	if _, err := p.js.PublishMsg(ctx, m, p.opts(ev.ID)...); err != nil {
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
	f, err := p.js.PublishMsgAsync(m, p.opts(ev.ID)...)
	if err != nil {
		return nil, fmt.Errorf("publish %s %s: %w", ev.Type(), ev.ID, err)
	}
	return f, nil
}

// PublishBatch sends evs and waits for the stream's acks, until ctx ends
// (5 s when ctx has no deadline). It returns nil when all were stored,
// else a *BatchError saying which failed; retrying those (or the whole
// batch, formed alike or not) is safe: consumers dedup by event id.
//
// It packs the events of each subject, in their order, into as few
// messages as fit the server's max payload (WithMaxPayload) and
// events.MaxBatchEvents: a message of several events is a batch
// (events.BatchContentType, compressed (WithCompression), Nats-Msg-Id
// events.BatchID of its events' ids, so the same batch sent again is
// stored once, compressed or not); a message of one event is
// the plain CloudEvent Publish sends. An id given twice is sent once, as
// JetStream would store it once. The messages go out asynchronously, and
// each one's ack or error is its events'. When the stream refuses a batch
// for its size, the Publisher reads the stream's MaxMsgSize (if its js can
// read streams, as a jetstream.JetStream does), packs to it from then on,
// and sends that batch's events again, once; every 1000 rounds sent whole
// under that limit, it reads the stream's MaxMsgSize again and packs up to
// what the stream takes now (never past the server's max payload).
func (p *Publisher) PublishBatch(ctx context.Context, evs []events.Event) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	errs := make([]error, len(evs))
	packedTo := p.budget.Load()
	big, dups := p.send(ctx, evs, errs)
	// Compared with the budget these events were packed to, not with the
	// one fitStream found: a concurrent round refused alike may have
	// lowered it first.
	if len(big) > 0 && p.fitStream(ctx) < packedTo {
		again := make([]events.Event, len(big))
		for k, i := range big {
			again[k] = evs[i]
		}
		errsAgain := make([]error, len(again))
		p.send(ctx, again, errsAgain)
		for k, i := range big {
			errs[i] = errsAgain[k]
		}
	}
	for i, j := range dups {
		errs[i] = errs[j]
	}
	for _, err := range errs {
		if err != nil {
			return &BatchError{Errs: errs}
		}
	}
	if p.budget.Load() < p.ceiling && p.fitted.Add(1)%refitAfter == 0 {
		p.fitStream(ctx)
	}
	return nil
}

// send packs evs (pack), publishes the messages and waits for their acks,
// setting errs[i] for each event that was not stored. It returns the
// events of batches the stream refused for their size, and the
// duplicates, whose errors the caller copies from their first copies.
func (p *Publisher) send(ctx context.Context, evs []events.Event, errs []error) (big []int, dups map[int]int) {
	type sent struct {
		f   jetstream.PubAckFuture
		idx []int // the events it carries
	}
	var msgs []sent
	groups, dups := p.pack(evs, errs)
	for _, group := range groups {
		m, id, err := p.message(evs, group)
		var f jetstream.PubAckFuture
		if err == nil {
			f, err = p.js.PublishMsgAsync(m, p.opts(id)...)
		}
		if err != nil {
			for _, i := range group.idx {
				errs[i] = fmt.Errorf("publish %s %s: %w", evs[i].Type(), evs[i].ID, err)
			}
			continue
		}
		msgs = append(msgs, sent{f, group.idx})
	}
	for _, s := range msgs {
		var err error
		select {
		case <-s.f.Ok():
		case err = <-s.f.Err():
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err == nil {
			continue
		}
		if len(s.idx) > 1 && errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) {
			big = append(big, s.idx...)
		}
		for _, i := range s.idx {
			errs[i] = fmt.Errorf("publish %s %s: %w", evs[i].Type(), evs[i].ID, err)
		}
	}
	slices.Sort(big) // sent again in the events' order
	return big, dups
}

// streamReader is what a Publisher reads its stream's MaxMsgSize with: a
// jetstream.JetStream is one.
type streamReader interface {
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
}

// fitStream sets p's budget to what the stream's MaxMsgSize takes, read
// now, at most the ceiling, and returns the budget: an older service's
// Ensure may have set a MaxMsgSize below the server's max payload, and a
// newer one raises it again. When the limit cannot be read, the budget
// stays. A read may be overtaken by a concurrent round's refusal that
// lowered the budget after a newer read: so the budget is raised only from
// the value loaded before this read (compare-and-swap: a refit's stale
// read never undoes that refusal's lowering), and otherwise only lowered.
func (p *Publisher) fitStream(ctx context.Context) int64 {
	before := p.budget.Load()
	sr, ok := p.js.(streamReader)
	if !ok {
		return before
	}
	s, err := sr.Stream(ctx, p.stream)
	if err != nil {
		return p.budget.Load() // the events keep the refusal's error
	}
	limit := s.CachedInfo().Config.MaxMsgSize
	if limit <= 0 {
		limit = math.MaxInt32 // no limit of the stream's own
	}
	b := min(int64(budget(int64(limit))), p.ceiling)
	if b > before {
		if p.budget.CompareAndSwap(before, b) {
			return b
		}
		return p.budget.Load()
	}
	for {
		cur := p.budget.Load()
		if b >= cur || p.budget.CompareAndSwap(cur, b) {
			return min(b, cur)
		}
	}
}

// packed is the events of one message: their indexes, the bytes of their
// encodings, and buf holding them as a batch without its closing ']'
// (events.AppendBatch's form: '[', then the encodings joined by ','), so
// that a batch message is built in place, not copied from a round's
// encodings.
type packed struct {
	idx  []int
	size int
	buf  []byte
}

// spare keeps buffers between a Publisher's rounds: up to spareBufs, their
// capacities at most maxSpare together, so that a round costs no allocation
// besides its messages' data (a reserved event's encoding is over a KiB, a
// round of a few hundred events a few hundred KiB, one message a type;
// compress adds its chunks' room for incompressible data). Not a sync.Pool:
// a pool keeps the buffer put back in its processor's private slot, which
// the next round, resumed on another processor, cannot take: it grew a new
// one (~1 KiB more allocated per admit, bench/results.md, issue 13,
// session 10). Two rounds may overlap (admission's outbox and its
// PublishNow batcher share a Publisher): then one grows what it lacks. The
// buffers stay while the Publisher does.
type spare struct {
	mu   sync.Mutex
	bufs [][]byte
}

// spareBufs and maxSpare bound the buffers kept: a round's messages (one a
// type, mostly one or two), and the rare huge round's kept from staying.
const (
	spareBufs = 4
	maxSpare  = 1 << 20
)

// take returns a buffer kept, empty, or nil.
func (s *spare) take() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.bufs)
	if n == 0 {
		return nil
	}
	b := s.bufs[n-1]
	s.bufs[n-1] = nil
	s.bufs = s.bufs[:n-1]
	return b[:0]
}

// give keeps b while the bounds allow, in place of the smallest kept
// buffer when that is smaller.
func (s *spare) give(b []byte) {
	if cap(b) == 0 || cap(b) > maxSpare {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	total, small := cap(b), -1
	for i, k := range s.bufs {
		total += cap(k)
		if small < 0 || cap(k) < cap(s.bufs[small]) {
			small = i
		}
	}
	switch {
	case len(s.bufs) < spareBufs && total <= maxSpare:
		s.bufs = append(s.bufs, b)
	case small >= 0 && cap(b) > cap(s.bufs[small]) && total-cap(s.bufs[small]) <= maxSpare:
		s.bufs[small] = b
	}
}

// pack encodes evs (an invalid one gets its error in errs and is left out)
// and packs them by subject, in order, into messages of at most
// events.MaxBatchEvents events and p's budget bytes (an event larger than
// that alone goes out alone, for the server to judge). An event whose id
// came earlier in evs is left out too, as JetStream would drop it: dups
// maps its index to the first's, whose result it shares. The messages'
// bufs are p.encoded's: the caller gives them back.
func (p *Publisher) pack(evs []events.Event, errs []error) (out []packed, dups map[int]int) {
	open := map[string]int{} // subject -> its last message in out
	first := make(map[string]int, len(evs))
	limit := int(p.budget.Load())
	e := make([]byte, 0, 2<<10) // one event's encoding, before it goes to its message (most fit)
	for i, ev := range evs {
		if j, ok := first[ev.ID]; ok {
			if dups == nil {
				dups = map[int]int{}
			}
			dups[i] = j
			continue
		}
		first[ev.ID] = i
		var err error
		if e, err = events.AppendEncode(e[:0], ev); err != nil {
			errs[i] = err
			continue
		}
		subj := ev.Type()
		if j, ok := open[subj]; ok {
			g := &out[j]
			if len(g.idx) < events.MaxBatchEvents && events.BatchSize(len(g.idx)+1, g.size+len(e)) <= limit {
				g.idx, g.size = append(g.idx, i), g.size+len(e)
				g.buf = append(append(g.buf, ','), e...)
				continue
			}
		}
		open[subj] = len(out)
		out = append(out, packed{idx: []int{i}, size: len(e), buf: append(append(p.encoded.take(), '['), e...)})
	}
	return out, dups
}

// message returns the message of the events of g and its Nats-Msg-Id, and
// gives g's buffer back to p.encoded.
func (p *Publisher) message(evs []events.Event, g packed) (*nats.Msg, string, error) {
	defer func() { p.encoded.give(g.buf) }()
	if len(g.idx) == 1 {
		ev := evs[g.idx[0]]
		// A copy: the message outlives g.buf (the async publisher may send it again).
		return p.single(ev, bytes.Clone(g.buf[1:])), ev.ID, nil
	}
	g.buf = append(g.buf, ']')
	return p.batch(evs, g.idx, g.buf)
}

// batch is the message of the events idx of evs, whose batch is joined.
func (p *Publisher) batch(evs []events.Event, idx []int, joined []byte) (*nats.Msg, string, error) {
	ids := make([]string, len(idx))
	for k, i := range idx {
		ids[k] = evs[i].ID
	}
	m := nats.NewMsg(events.Subject(p.prefix, evs[idx[0]].Type()))
	if p.plain {
		m.Data = bytes.Clone(joined)
	} else {
		var err error
		if m.Data, err = p.compress(joined); err != nil {
			return nil, "", err
		}
		m.Header.Set(HeaderContentEncoding, EncodingS2)
	}
	m.Header.Set("Content-Type", events.BatchContentType)
	if p.ownTime {
		m.Header.Set(HeaderFirstStored, FirstStoredOwn)
	}
	return m, events.BatchID(ids), nil
}

// compressChunk is how many bytes of a batch S2 compresses at once: S2
// wants room for incompressible data, s2.MaxEncodedLen of what it
// compresses, which for a whole batch of a few hundred events is more
// than the batch (~385 kB for 330 kB). A 64 KiB chunk (about 50 reserved
// events) loses little: 250 reserved events of the five-limit plan, 257 kB,
// compress to 18,690 bytes in 64 KiB chunks, 18,103 whole (16 KiB: 24,237).
const compressChunk = 64 << 10

// compress returns joined as one S2 block: its chunks compressed one after
// another into p.compressed's buffer, then joined (s2.ConcatBlocks) into
// the message's data, a copy of exactly its size (it lives until
// acknowledged).
func (p *Publisher) compress(joined []byte) ([]byte, error) {
	buf := p.compressed.take()
	defer func() { p.compressed.give(buf) }()
	var ends []int
	for rest := joined; len(rest) > 0; {
		n := min(len(rest), compressChunk)
		buf = slices.Grow(buf, s2.MaxEncodedLen(n))
		// With that room s2 writes in place: the append copies nothing.
		buf = append(buf, s2.Encode(buf[len(buf):cap(buf)], rest[:n])...)
		ends = append(ends, len(buf))
		rest = rest[n:]
	}
	blocks := make([][]byte, len(ends))
	start := 0
	for i, end := range ends {
		blocks[i], start = buf[start:end], end
	}
	data, err := s2.ConcatBlocks(nil, blocks...)
	if err != nil {
		return nil, fmt.Errorf("compress batch: %w", err)
	}
	return data, nil
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
// than Nats-* ones are kept. (Delivery.Finish dead-letters one event of a
// batch alone.)
func DeadLetter(ctx context.Context, js jetstream.Publisher, cfg Config, reason string, msg jetstream.Msg, cause error) error {
	return deadLetter(ctx, js, cfg, reason, msg, cause, nil)
}

// deadLetter is DeadLetter of msg, or of its event part when part is set:
// that event's bytes as a single CloudEvent, with HeaderBatchIndex, its
// own first-stored time, and the index in its Nats-Msg-Id.
func deadLetter(ctx context.Context, js jetstream.Publisher, cfg Config, reason string, msg jetstream.Msg, cause error, part *letterPart) error {
	dl := nats.NewMsg(events.DLQSubject(cfg.WithDefaults().SubjectPrefix, reason))
	dl.Data = msg.Data()
	for k, v := range msg.Headers() {
		if !strings.HasPrefix(strings.ToLower(k), "nats-") {
			dl.Header[k] = v
		}
	}
	suffix := ""
	stored := FirstStored(msg)
	if part != nil {
		dl.Data = part.data
		dl.Header.Del(HeaderContentEncoding) // the event alone, decompressed
		dl.Header.Set("Content-Type", events.ContentType)
		dl.Header.Set(HeaderBatchIndex, strconv.Itoa(part.index))
		dl.Header.Del(HeaderFirstStored)
		stored = part.stored
		suffix = part.suffix()
	}
	// A replay is judged by when the event was first stored (a batch
	// dead-lettered whole keeps saying FirstStoredOwn).
	if dl.Header.Get(HeaderFirstStored) != FirstStoredOwn && !stored.IsZero() {
		dl.Header.Set(HeaderFirstStored, stored.UTC().Format(time.RFC3339Nano))
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
		seq := strconv.FormatUint(md.Sequence.Stream, 10)
		dl.Header.Set(HeaderStream, md.Stream)
		dl.Header.Set(HeaderSequence, seq)
		dl.Header.Set(HeaderDelivered, strconv.FormatUint(md.NumDelivered, 10))
		opts = append(opts, jetstream.WithMsgID("dlq."+md.Stream+"."+seq+suffix))
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if _, err := js.PublishMsg(ctx, dl, opts...); err != nil {
		return fmt.Errorf("dead-letter %s%s to %s: %w", msg.Subject(), suffix, dl.Subject, err)
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
