package outbox

import (
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The queue holds memory for what it holds, not for its bound: an outbox
// bounded at a million events starts with far less than the ~96 MB a
// channel of that capacity would take (and every garbage collection scan).
func TestQueueHoldsWhatIsQueued(t *testing.T) {
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	o, err := New(newFakePublisher(false), Options{SpillDir: t.TempDir(), MaxEvents: 1_000_000, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&m1)
	defer closeOutbox(t, o, 5*time.Second)
	if got := m1.TotalAlloc - m0.TotalAlloc; got > 1<<20 {
		t.Errorf("New(MaxEvents: 1e6) allocated %d bytes, want under 1 MiB", got)
	}
}

// push refuses past the bound; take keeps the order and its limit, and
// gives a backlog's memory back once empty; arm wakes the publisher once
// as many events as it asked for are queued, or the queue is full, and not
// before.
func TestQueueArmTake(t *testing.T) {
	q := newQueue(5)
	ready := func() bool {
		select {
		case <-q.ready:
			return true
		default:
			return false
		}
	}
	if q.arm(1) || ready() {
		t.Fatal("arm(1) on an empty queue: already there or woken")
	}
	q.push(reserved(0), testNow)
	if !ready() {
		t.Fatal("the first event did not wake a publisher armed for 1")
	}
	if q.arm(3) {
		t.Fatal("arm(3) with 1 queued reports them there")
	}
	q.push(reserved(1), testNow)
	if ready() {
		t.Fatal("woken with 2 of the 3 armed for")
	}
	q.push(reserved(2), testNow)
	if !ready() {
		t.Fatal("not woken with the 3 armed for")
	}
	if !q.arm(3) {
		t.Fatal("arm(3) with 3 queued does not report them there")
	}
	if q.arm(8) || ready() {
		t.Fatal("arm(8) with 3 queued: already there or woken")
	}
	q.push(reserved(3), testNow)
	if ready() {
		t.Fatal("woken with 4 queued, armed for 8 in a queue of 5")
	}
	q.push(reserved(4), testNow)
	if !ready() {
		t.Fatal("a full queue did not wake a publisher armed for more than it holds")
	}
	if q.push(reserved(5), testNow) {
		t.Fatal("push past the bound of 5 accepted")
	}

	batch, arrived := q.take(nil, nil, 2)
	batch, arrived = q.take(batch, arrived, 4) // up to 4 in all: 2 more
	if len(batch) != 4 || len(arrived) != 4 || q.len() != 1 {
		t.Fatalf("take(2), take(to 4) = %d events, %d times, %d left; want 4, 4, 1", len(batch), len(arrived), q.len())
	}
	for i, ev := range batch {
		if ev.ID != reserved(i).ID {
			t.Fatalf("batch[%d] = %s, want %s (queue order)", i, ev.ID, reserved(i).ID)
		}
	}

	// Room taken from the front is used again, in order.
	for i := 5; i < 9; i++ {
		if !q.push(reserved(i), testNow) {
			t.Fatalf("push %d with %d queued of 5 refused", i, q.len())
		}
	}
	rest, _ := q.take(nil, nil, 10)
	for i, ev := range rest {
		if want := reserved(4 + i).ID; ev.ID != want {
			t.Fatalf("after reuse, event %d = %s, want %s", i, ev.ID, want)
		}
	}
	if len(rest) != 5 || q.len() != 0 {
		t.Fatalf("take of the rest = %d events, %d left; want 5, 0", len(rest), q.len())
	}

	big := newQueue(10 * keepCap)
	for i := range 2 * keepCap {
		big.push(reserved(i), testNow)
	}
	if batch, _ := big.take(nil, nil, 4*keepCap); len(batch) != 2*keepCap || big.len() != 0 || big.evs != nil {
		t.Errorf("take of a %d-event backlog = %d events, %d left, room for %d kept; want all, 0, none", 2*keepCap, len(batch), big.len(), cap(big.evs))
	}
}
