package outbox

import (
	"sync"
	"time"

	"quotaflow/pkg/events"
)

// queue is the outbox's in-memory queue of events, bounded by a count. It
// is a slice under a mutex rather than a channel of that capacity: a
// channel holds its whole bound from the start (10,000 events of 96 bytes
// with pointers: about a quarter of admission's live heap, which every
// garbage collection scans), while the slice holds what is queued
// (measured under load in two runs: heap in use 13.0 → 8.8 and 10.8 →
// 10.5 MB, RSS 0–2 MiB lower, for allocations per admit 7.96 → 8.41 and
// 8.43 → 8.50 KiB; bench/results.md, "Admission's tail and memory
// (session 4)"); and a receiver waiting on a channel is woken for every
// event sent, while the publisher only needs waking when it has work: the
// first event after idling, or enough to fill its round (arm) (fewer
// wake-ups, not measured apart).
type queue struct {
	mu    sync.Mutex
	evs   []queued // evs[head:] are queued, oldest first
	head  int
	bound int
	want  int           // wake the publisher once this many are queued; 0: it is not waiting
	ready chan struct{} // a wake-up, buffered so that none is lost
}

// queued is an event in the queue, with when it came, for the wait
// metric.
type queued struct {
	ev events.Event
	at time.Time
}

// keepCap is the capacity an empty queue keeps for reuse; a backlog's
// larger slice is given back once the queue empties.
const keepCap = 1024

func newQueue(bound int) *queue {
	return &queue{bound: bound, ready: make(chan struct{}, 1)}
}

// push adds ev, queued at at, unless the queue holds bound events; it wakes
// the publisher when it armed a wake-up for this many.
func (q *queue) push(ev events.Event, at time.Time) bool {
	q.mu.Lock()
	if len(q.evs)-q.head >= q.bound {
		q.mu.Unlock()
		return false
	}
	if q.head > 0 && len(q.evs) == cap(q.evs) { // move the queued to the front rather than grow
		n := copy(q.evs, q.evs[q.head:])
		clear(q.evs[n:])
		q.evs, q.head = q.evs[:n], 0
	}
	q.evs = append(q.evs, queued{ev: ev, at: at})
	wake := q.want > 0 && len(q.evs)-q.head >= q.want
	if wake {
		q.want = 0
	}
	q.mu.Unlock()
	if wake {
		select {
		case q.ready <- struct{}{}:
		default: // a wake-up is pending already
		}
	}
	return true
}

// arm asks for a wake-up on ready once n events are queued (or the queue
// is full, so that a round waiting for more takes them rather than letting
// the next ones spill), and reports whether they already are (then none is
// armed). A wake-up may come with fewer (one left from an earlier arm):
// the publisher looks again.
func (q *queue) arm(n int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	n = min(n, q.bound)
	if len(q.evs)-q.head >= n {
		q.want = 0
		return true
	}
	q.want = n
	return false
}

// take moves the oldest events into batch, and their arrival times into
// arrived, until batch holds limit events or the queue is empty.
func (q *queue) take(batch []events.Event, arrived []time.Time, limit int) ([]events.Event, []time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	taken := q.evs[q.head:][:min(max(limit-len(batch), 0), len(q.evs)-q.head)]
	for _, x := range taken {
		batch, arrived = append(batch, x.ev), append(arrived, x.at)
	}
	clear(taken) // the batch holds them now
	q.head += len(taken)
	if q.head == len(q.evs) {
		q.evs, q.head = q.evs[:0], 0
		if cap(q.evs) > keepCap {
			q.evs = nil
		}
	}
	return batch, arrived
}

// len is how many events are queued.
func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.evs) - q.head
}
