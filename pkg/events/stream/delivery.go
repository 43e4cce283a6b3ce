package stream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// HeaderBatchIndex, on the dead letter of one event of a batch, is the
// event's index in the batch (from 0); the dead letter holds that event
// alone, as a single CloudEvent.
const HeaderBatchIndex = "Quotaflow-Batch-Index"

// Delivery is a message of the usage stream and its events: one for a
// single CloudEvent, one per element for a batch. Events[i] is valid when
// Errs[i] is nil; an invalid one is dead-lettered alone by Finish. Make
// one with DecodeMsg, handle its valid events, and end it with Finish.
type Delivery struct {
	Msg    jetstream.Msg
	Events []events.Event
	Errs   []error
	// raw[i] is event i's bytes in a batch; nil for a single event.
	raw    [][]byte
	data   []byte    // the message's payload, decompressed (Payload)
	stored time.Time // the message's FirstStored
	own    bool      // a batch saying FirstStoredOwn
}

// Batch reports whether the message is a batch.
func (d *Delivery) Batch() bool { return d.raw != nil }

// Raw is event i's bytes: the message's payload (decompressed) for a
// single event, the element for a batch.
func (d *Delivery) Raw(i int) []byte {
	if d.raw == nil {
		return d.data
	}
	return d.raw[i]
}

// FirstStored is when event i was first stored: for a batch of a
// Publisher made WithOwnTime its own time, but no later than when the
// stream stored the batch; else, and for an event that is invalid, the
// message's (FirstStored).
func (d *Delivery) FirstStored(i int) time.Time {
	if d.own && !d.Events[i].Time.IsZero() {
		return earliest(d.Events[i].Time, d.stored)
	}
	return d.stored
}

// DecodeMsg decodes msg's events (events.Decode, events.DecodeBatch when
// its Content-Type is events.BatchContentType, of its payload decompressed
// as its Content-Encoding says: Payload) and checks each one's time
// against its first storage (events.CheckTime, with cfg's MaxAge): what a
// consumer of the usage stream accepts. Its error, wrapping
// events.ErrInvalid, is for a message that is bad as a whole (an invalid
// single event, a malformed batch): dead-letter it (Reject), retrying
// cannot help. An invalid event of a batch is in Errs.
func DecodeMsg(msg jetstream.Msg, cfg Config) (*Delivery, error) {
	return DecodeMsgWith(msg, cfg, events.Decoder{})
}

// DecodeMsgWith is DecodeMsg, decoding the events with dec: a consumer
// that reads less of them checks less (events.Decoder.NoSnapshots).
func DecodeMsgWith(msg jetstream.Msg, cfg Config, dec events.Decoder) (*Delivery, error) {
	d := &Delivery{Msg: msg, stored: FirstStored(msg)}
	data, err := Payload(msg.Headers(), msg.Data())
	if err != nil {
		return nil, err
	}
	d.data = data
	if events.IsBatch(msg.Headers().Get("Content-Type")) {
		evs, errs, raw, err := dec.DecodeBatch(data)
		if err != nil {
			return nil, err
		}
		d.Events, d.Errs, d.raw = evs, errs, raw
		// Only a batch says "own"; a single event's header is a time.
		d.own = msg.Headers().Get(HeaderFirstStored) == FirstStoredOwn
	} else {
		ev, err := dec.Decode(data)
		if err != nil {
			return nil, err
		}
		d.Events, d.Errs = []events.Event{ev}, []error{nil}
	}
	maxAge := cfg.WithDefaults().MaxAge
	for i, ev := range d.Events {
		if d.Errs[i] != nil {
			continue
		}
		if stored := d.FirstStored(i); !stored.IsZero() {
			if err := events.CheckTime(ev.Time, stored, maxAge); err != nil {
				d.Events[i], d.Errs[i] = events.Event{}, err
			}
		}
	}
	if !d.Batch() && d.Errs[0] != nil {
		return nil, d.Errs[0]
	}
	return d, nil
}

// FetchMaxBytes bounds the bytes one fetch of a usage stream consumer
// takes (Fetch): about four of the largest messages the stream stores
// (Ensure's MaxMsgSize) and room for their subjects and replies, so that a
// fetch of many full batches holds a few MiB rather than its message count
// times 1 MiB. It must never be less than one such message: the server
// holds a message larger than a fetch's bytes back from every fetch.
const FetchMaxBytes = 4 * (events.MaxBatchSize + headerRoom + 1<<10)

// fetchGrace is how long after its wait, and after its last message once
// the wait has passed, Fetch waits for a pull's end.
const fetchGrace = 100 * time.Millisecond

// Fetched is what one Fetch took: the messages and when they were
// requested, which is no later than any was delivered.
type Fetched struct {
	Msgs []jetstream.Msg
	At   time.Time
}

// Fetch takes the next messages of cons, a consumer made by
// EnsureConsumer: up to max messages and FetchMaxBytes, waiting at most
// wait for them. Its error is the fetch's: no messages is no error; msgs
// that arrived before a failure are returned with it. Split them with Runs
// or RunsBy.
func Fetch(cons jetstream.Consumer, max int, wait time.Duration) (Fetched, error) {
	f := Fetched{At: time.Now()}
	batch, err := cons.Fetch(max, jetstream.FetchMaxWait(wait), jetstream.FetchMaxBytes(FetchMaxBytes))
	if err != nil {
		return f, fmt.Errorf("fetch from %s: %w", cons.CachedInfo().Name, err)
	}
	// The server ends a pull at its wait with a status the client waits
	// for; now and then it ends one without (nats-server 2.9 under load:
	// ~1 fetch in 10), and the client gives up a second after the last
	// message. The fetch stops a little after the wait instead (after its
	// last message, while a large fetch is still coming in), with what
	// has arrived; a message that comes later is nak'ed, to come again.
	stop := time.NewTimer(wait + fetchGrace)
	defer stop.Stop()
	msgs := batch.Messages()
	for closed := false; !closed; {
		select {
		case msg, ok := <-msgs:
			if closed = !ok; ok {
				f.Msgs = append(f.Msgs, msg)
				if time.Since(f.At) > wait {
					stop.Reset(fetchGrace)
				}
			}
		case <-stop.C:
			for len(msgs) > 0 { // arrived already; Fetch is the one receiver
				f.Msgs = append(f.Msgs, <-msgs)
			}
			go func() {
				for msg := range msgs { // until the client ends the pull
					_ = msg.Nak()
				}
			}()
			return f, nil
		}
	}
	if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return f, fmt.Errorf("fetch from %s: %w", cons.CachedInfo().Name, err)
	}
	return f, nil
}

// Bursts fetches a consumer's messages in bursts: each fetch first waits
// out its interval (every) since the last one ended, with no pull at the
// server, then takes what is stored at once. A pull left waiting at the
// server is handed each message as it is stored, one delivery and one
// wake-up of the server's and the client's goroutines per message, which
// in the pipeline cost nats-server more than the message itself
// (bench/results.md, "Consumers fetch in bursts"). A fetch that left a
// backlog is followed by the next at once (backlog). Not safe for
// concurrent use.
type Bursts struct {
	cons  jetstream.Consumer
	max   int
	every time.Duration
	ended time.Time // when the last fetch ended
	more  bool      // the last fetch left a backlog
}

// burstWait is how long a burst's pull lasts: long enough for a busy
// server to start delivering before the pull expires (an expired pull
// gets nothing), short since what it is handed meanwhile comes a message
// at a time. Not FetchNoWait: it takes no byte bound (FetchMaxBytes).
const burstWait = 25 * time.Millisecond

// NewBursts returns Bursts of up to max messages (and FetchMaxBytes) from
// cons, a fetch every interval at most while there is no backlog.
func NewBursts(cons jetstream.Consumer, max int, every time.Duration) *Bursts {
	return &Bursts{cons: cons, max: max, every: every}
}

// Fetch waits out the interval since the last fetch ended, unless that
// one left a backlog, then fetches as Fetch does. If ctx ends while it
// waits, it returns no messages and ctx's error.
func (b *Bursts) Fetch(ctx context.Context) (Fetched, error) {
	if d := time.Until(b.ended.Add(b.every)); d > 0 && !b.more {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return Fetched{At: time.Now()}, ctx.Err()
		}
	}
	f, err := Fetch(b.cons, b.max, burstWait)
	b.ended, b.more = time.Now(), backlog(f.Msgs, b.max)
	return f, err
}

// backlog reports whether a fetch of up to size messages left a backlog:
// it was cut by its count or came near its byte bound (redelivered
// messages, which no count of pending ones includes, may wait), or the
// consumer still had a quarter of a fetch pending when the last message
// was delivered (not the few stored while the pull lasted).
func backlog(msgs []jetstream.Msg, size int) bool {
	if len(msgs) == 0 {
		return false
	}
	if len(msgs) >= size {
		return true
	}
	bytes := 0
	for _, m := range msgs {
		bytes += len(m.Data())
	}
	if bytes >= FetchMaxBytes/2 {
		return true
	}
	md, err := msgs[len(msgs)-1].Metadata()
	return err == nil && md.NumPending >= uint64(max(1, size/4))
}

// Groups calls handle with ds, the decoded messages of f, split by Runs,
// one run after the other (a Pending of f's runs).
func Groups(f Fetched, ds []*Delivery, max int, cfg Config, handle func([]*Delivery)) {
	p := NewPending(cfg)
	p.Add(f, Runs(ds, max), nil)
	for run, ok := p.Next(); ok; run, ok = p.Next() {
		handle(run)
	}
}

// Runs splits ds, in order, into runs of whole messages of at most size
// events each (a message of more is a run alone): the batches a consumer
// handles in one transaction each, whose size its messages' batches must
// not blow up.
func Runs(ds []*Delivery, size int) [][]*Delivery { return runs(ds, size, nil) }

// RunsBy is Runs ending each run that ds does not end where the fewest of
// key's groups have events on both sides, among the cuts that leave the
// run at least half of size events (the latest of equals). A consumer keys
// a request's events by the request, which writes its ledger row once when
// they share a batch; events key reports false for belong to no group.
//
// The messages from hold on may be held for the next fetch, where the
// groups they start may end: ds is cut after the message (hold-1 or later,
// the first at least) where the fewest groups are parted, counting both
// those with events on both sides and those of one event from hold on,
// whose others may come next (the latest of equals); held is the rest.
// hold = len(ds) holds nothing.
func RunsBy[K comparable](ds []*Delivery, size int, key func(events.Event) (K, bool), hold int) ([][]*Delivery, []*Delivery) {
	// span is the first and last message holding a group's events.
	type span struct{ first, last int }
	spans := make(map[K]span)
	for i, d := range ds {
		for _, ev := range d.Events {
			k, ok := key(ev)
			if !ok {
				continue
			}
			if s, seen := spans[k]; seen {
				spans[k] = span{s.first, i}
			} else {
				spans[k] = span{i, i}
			}
		}
	}
	// split[i] is how many groups a cut after message i parts: those with
	// first <= i < last, summed from +1 at first and -1 at last.
	split := make([]int, len(ds)+1)
	for _, s := range spans {
		if s.first < s.last {
			split[s.first]++
			split[s.last]--
		}
	}
	for i := 1; i < len(ds); i++ {
		split[i] += split[i-1]
	}
	keep := len(ds)
	if hold < len(ds) {
		single := make([]int, len(ds))
		for _, s := range spans {
			if s.first == s.last && s.first >= hold {
				single[s.first]++
			}
		}
		best, least, singles := -1, 0, 0
		for c := max(hold-1, 0); c < len(ds); c++ {
			if c >= hold {
				singles += single[c]
			}
			if cost := split[c] + singles; best < 0 || cost <= least {
				best, least = c, cost
			}
		}
		keep = best + 1
	}
	return runs(ds[:keep], size, split[:keep]), ds[keep:]
}

func runs(ds []*Delivery, size int, split []int) [][]*Delivery {
	var out [][]*Delivery
	for start := 0; start < len(ds); {
		end, n := start, 0
		best := -1 // the cut RunsBy prefers: after message best-1
		for end < len(ds) && (end == start || n+len(ds[end].Events) <= size) {
			n += len(ds[end].Events)
			end++
			if split != nil && end < len(ds) && 2*n >= size && (best < 0 || split[end-1] <= split[best-1]) {
				best = end
			}
		}
		if end < len(ds) && best > 0 {
			end = best
		}
		out = append(out, ds[start:end])
		start = end
	}
	return out
}

// Pending holds runs of fetched messages until workers take them, and
// messages held for a later fetch's runs (RunsBy's held), and keeps them
// from being redelivered meanwhile: the server's AckWait of each message
// runs from its delivery, so when a run is taken more than a quarter of
// AckWait after the fetch of the oldest message waiting or after the last
// such mark, every message waiting (this run's, the other runs', the held)
// is first marked in progress (Msg.InProgress) and gets AckWait anew. A
// run must then be handled within about three quarters of AckWait;
// promptly taken runs cost the server nothing more. It is safe for
// concurrent use.
type Pending struct {
	mu     sync.Mutex
	runs   [][]*Delivery
	held   []*Delivery
	heldAt time.Time
	late   time.Duration
	marked time.Time
}

// NewPending returns an empty Pending for the consumers of cfg.
func NewPending(cfg Config) *Pending {
	return &Pending{late: cfg.WithDefaults().AckWait / 4}
}

// Add queues runs, messages fetched at f.At or later, after those
// pending, and holds held, which TakeHeld returns (held replaces what was
// held: take it first).
func (p *Pending) Add(f Fetched, runs [][]*Delivery, held []*Delivery) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if (len(p.runs) == 0 && len(p.held) == 0) || f.At.Before(p.marked) {
		p.marked = f.At
	}
	p.runs = append(p.runs, runs...)
	p.held, p.heldAt = held, f.At
}

// TakeHeld returns the messages held and the time Add was given with
// them, and holds none.
func (p *Pending) TakeHeld() ([]*Delivery, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	held := p.held
	p.held = nil
	return held, p.heldAt
}

// Waiting reports whether a run is pending.
func (p *Pending) Waiting() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.runs) > 0
}

// Next takes the first pending run; false when none is.
func (p *Pending) Next() ([]*Delivery, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.runs) == 0 {
		return nil, false
	}
	if time.Since(p.marked) > p.late {
		p.marked = time.Now()
		for _, run := range p.runs {
			markInProgress(run)
		}
		markInProgress(p.held)
	}
	run := p.runs[0]
	p.runs[0] = nil
	p.runs = p.runs[1:]
	return run, true
}

func markInProgress(ds []*Delivery) {
	for _, d := range ds {
		_ = d.Msg.InProgress() // if lost, AckWait redelivers and handlers are idempotent
	}
}

// Status is what became of one event of a Delivery.
type Status uint8

const (
	// Acked: handled, and the message acked.
	Acked Status = iota
	// Retried: the message comes back (nak'ed) and the event with it.
	Retried
	// DeadLettered: the event is in the dead-letter stream.
	DeadLettered
)

// permanent marks a handler's error that no retry can fix.
type permanent struct {
	reason string
	err    error
}

func (p *permanent) Error() string { return p.err.Error() }
func (p *permanent) Unwrap() error { return p.err }

// Permanent marks err, a handler's error, as the event's own fault that no
// retry can fix (Postgres refused to store it): Finish dead-letters the
// event under reason at once.
func Permanent(reason string, err error) error { return &permanent{reason, err} }

// outage marks a handler's error as a dependency's outage.
type outage struct{ err error }

func (o *outage) Error() string { return o.err.Error() }
func (o *outage) Unwrap() error { return o.err }

// Outage marks err, a handler's error, as an outage of a dependency
// (Postgres, Redis or NATS unreachable) rather than a problem of the
// event: Finish naks the message with the backoff without end, and never
// dead-letters the event for it, so an outage never dead-letters good
// events.
func Outage(err error) error { return &outage{err} }

// Finish ends the delivery of d's message, whose valid events were handled
// with results herrs (herrs[i] for d.Events[i]; ignored where d.Errs[i] is
// set), and says what became of each event:
//
//   - each invalid event, and each whose error is Permanent, is
//     dead-lettered alone (ReasonInvalid, or Permanent's reason);
//   - when every other event succeeded, the message is acked (terminated
//     when none did);
//   - else the whole message is nak'ed, the events that succeeded are
//     handled again on redelivery (handlers are idempotent): at once when
//     ctx has ended (shutdown), with the backoff (1 s doubling per delivery
//     up to cfg.AckWait) otherwise; but on its cfg.MaxDeliver-th delivery,
//     unless an error is an Outage, the failing events are dead-lettered
//     (ReasonMaxDeliver) and the message acked;
//   - when a dead letter cannot be published, the message is nak'ed to come
//     back a second later (the dead letters already stored are stored once:
//     their ids derive from the stream, sequence and index).
//
// It returns nil when the message was acked with every event handled, an
// error wrapping ErrDeadLettered (and the causes) when events were
// dead-lettered and the message is done with, and any other error when it
// will be redelivered.
func (d *Delivery) Finish(ctx context.Context, js jetstream.Publisher, cfg Config, herrs []error) ([]Status, error) {
	cfg = cfg.WithDefaults()
	st := make([]Status, len(d.Events))
	var delivered uint64 = 1
	if md, err := d.Msg.Metadata(); err == nil {
		delivered = md.NumDelivered
	}
	var (
		lettered []error // causes of the dead letters
		dlqErr   error   // a dead letter that could not be published
		failed   []int   // events to retry
		out      bool    // an outage among the failures
		handled  int
	)
	letter := func(i int, reason string, cause error) {
		if err := d.deadLetter(ctx, js, cfg, reason, i, cause); err != nil {
			dlqErr = errors.Join(dlqErr, err)
			st[i] = Retried
			return
		}
		st[i] = DeadLettered
		lettered = append(lettered, fmt.Errorf("(%s) %w", reason, cause))
	}
	for i := range d.Events {
		var p *permanent
		var o *outage
		switch herr := herrs[i]; {
		case d.Errs[i] != nil:
			letter(i, ReasonInvalid, d.Errs[i])
		case herr == nil:
			handled++
		case errors.As(herr, &p):
			letter(i, p.reason, p.err)
		default:
			out = out || errors.As(herr, &o)
			failed = append(failed, i)
		}
	}
	if len(failed) > 0 && !out && ctx.Err() == nil && delivered >= uint64(cfg.MaxDeliver) {
		for _, i := range failed {
			ev := d.Events[i]
			letter(i, ReasonMaxDeliver, fmt.Errorf("%s %s: delivered %d times, last error: %w", ev.Type(), ev.ID, delivered, herrs[i]))
		}
		failed = nil
	}
	retry := func(delay time.Duration, cause error) ([]Status, error) {
		for i := range st {
			if st[i] != DeadLettered {
				st[i] = Retried
			}
		}
		if delay < 0 {
			_ = d.Msg.Nak()
		} else {
			_ = d.Msg.NakWithDelay(delay) // if lost, AckWait redelivers
		}
		return st, cause
	}
	switch {
	case dlqErr != nil:
		return retry(time.Second, dlqErr)
	case len(failed) > 0:
		ev := d.Events[failed[0]]
		cause := fmt.Errorf("handle %s %s (delivery %d, %d of %d events failed): %w",
			ev.Type(), ev.ID, delivered, len(failed), len(d.Events), herrs[failed[0]])
		if ctx.Err() != nil {
			return retry(-1, cause) // shutting down: hand it to another worker now
		}
		return retry(backoff(delivered, cfg.AckWait), cause)
	}
	end := d.Msg.Ack
	if handled == 0 {
		end = d.Msg.Term
	}
	if err := end(); err != nil {
		// A redelivery handles it again; the dead letters dedup.
		return retry(-1, fmt.Errorf("ack %s: %w", d.Msg.Subject(), err))
	}
	if len(lettered) > 0 {
		return st, fmt.Errorf("%w: %w", ErrDeadLettered, errors.Join(lettered...))
	}
	return st, nil
}

// deadLetter dead-letters event i: the whole message for a single event
// (DeadLetter), the event alone for a batch (its bytes as a single
// CloudEvent, HeaderBatchIndex i, Nats-Msg-Id from stream, sequence and
// index).
func (d *Delivery) deadLetter(ctx context.Context, js jetstream.Publisher, cfg Config, reason string, i int, cause error) error {
	if !d.Batch() {
		return DeadLetter(ctx, js, cfg, reason, d.Msg, cause)
	}
	return deadLetter(ctx, js, cfg, reason, d.Msg, cause, &letterPart{
		index:  i,
		data:   d.raw[i],
		stored: d.FirstStored(i),
	})
}

// letterPart is the one event of a batch that a dead letter holds.
type letterPart struct {
	index  int
	data   []byte
	stored time.Time // when it was first stored; zero if unknown
}

func (p *letterPart) suffix() string { return "." + strconv.Itoa(p.index) }
