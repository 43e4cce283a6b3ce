package decide

import (
	"hash/maphash"
	"log/slog"
	"sync"
)

// localTable holds the local state: one slot per owner and limit, in a
// fixed array allocated once at its cap, without a pointer, so that the
// garbage collector never scans it (with 100k subjects remembered it is most
// of admission's live heap, and scanning it was most of the collector's
// work) and it never grows.
//
// It is set-associative: an owner's slots all live in one bucket of
// bucketSlots, chosen by the owner's hash, under that bucket's mutex, which
// makes a local decision over an owner's limits all-or-nothing. A slot
// needed when its bucket is full takes the least recently used one,
// whichever owner it belongs to: the table forgets the least recently used
// limits of an owner's neighbours first, with O(bucketSlots) work and no
// list. A slot used within the current hold of its bucket's lock is never
// taken, so pointers to the slots of one decision stay good while it holds
// the lock; past bucketSlots limits in one decision, the rest are decided
// from a fresh state, as for an owner forgotten.
//
// gens[i] counts the states slots[i] has held, so that a spending is given
// back only to the state it was taken from, not to one of the same owner
// and limit created there since (a give-back would wrap it only after 2³²
// new states in that slot within one request).
//
// Owners are kept by a 64-bit hash of their key, not the key: the table
// holds no strings (a request's tenant and user do not outlive it). Two
// owners whose hashes collide (odds about n²/2⁶⁵ for n owners) share their
// local state, which only matters while Redis is unavailable.
type localTable struct {
	heads []bucketHead
	slots []slot   // bucket b is slots[b*bucketSlots:][:bucketSlots]
	gens  []uint32 // gens[i]: the states slots[i] has held
}

// bucketSlots is the associativity: an owner remembers up to this many
// limits, and a bucket's lookup reads this many 48-byte slots (12 cache
// lines) at most.
const bucketSlots = 16

// slotsPerOwner sizes the table from Options.LocalEntries: a subject
// remembers its token quotas, three in the benchmarks' five-limit plan.
const slotsPerOwner = 3

type bucketHead struct {
	mu    sync.Mutex
	clock uint16 // the current hold of mu, stamped on the slots it uses
}

// slot is one owner's state of one limit, 48 bytes without a pointer.
type slot struct {
	owner uint64 // the owner's hash; 0: free
	ruleState
}

// owner names an owner's bucket and hash in a localTable.
type owner struct {
	b int
	h uint64
}

// newLocalTable returns a table for entries owners; log hears of a
// fallback to the heap.
func newLocalTable(entries int, log *slog.Logger) *localTable {
	n := max(1, (entries*slotsPerOwner+bucketSlots-1)/bucketSlots)
	t := &localTable{heads: make([]bucketHead, n)}
	t.alloc(n*bucketSlots, log)
	return t
}

// onHeap allocates n slots and their generations on the heap.
func (t *localTable) onHeap(n int) {
	t.slots, t.gens = make([]slot, n), make([]uint32, n)
}

// owner returns the handle of k.
func (t *localTable) owner(k ownerKey) owner {
	h := maphash.Comparable(hashSeed, k)
	if h == 0 { // 0 marks a free slot
		h = 1
	}
	return owner{b: int(h % uint64(len(t.heads))), h: h}
}

// lock takes the bucket of a, and of b when it is another bucket, in bucket
// order so that two decisions over the same pair cannot deadlock; a zero
// b (b.h == 0) is none. unlock releases them.
func (t *localTable) lock(a, b owner) {
	if b.h == 0 || b.b == a.b {
		t.hold(a.b)
		return
	}
	lo, hi := min(a.b, b.b), max(a.b, b.b)
	t.hold(lo)
	t.hold(hi)
}

func (t *localTable) hold(b int) {
	h := &t.heads[b]
	h.mu.Lock()
	h.clock++
}

func (t *localTable) unlock(a, b owner) {
	t.heads[a.b].mu.Unlock()
	if b.h != 0 && b.b != a.b {
		t.heads[b.b].mu.Unlock()
	}
}

// index returns the index of o's slot of state id, taking a free or the
// least recently used slot of its bucket for a new one, or -1 when every
// slot of the bucket was used within this hold of its lock; caller holds
// o's bucket. An index stays good until the lock is released.
func (t *localTable) index(o owner, id uint32) int {
	clock := t.heads[o.b].clock
	base := o.b * bucketSlots
	victim, age := -1, uint16(0)
	for i := base; i < base+bucketSlots; i++ {
		s := &t.slots[i]
		if s.owner == o.h && s.id == id {
			s.used = clock
			return i
		}
		// Ages count holds of the lock modulo 2¹⁶: a slot unused for
		// longer may look recent, which only makes it a later victim.
		a := clock - s.used
		if s.owner == 0 {
			a = ^uint16(0)
		}
		if a > age || (victim < 0 && a > 0) {
			victim, age = i, a
		}
	}
	if victim < 0 {
		return -1
	}
	t.slots[victim] = slot{owner: o.h, ruleState: ruleState{id: id, used: clock}}
	t.gens[victim]++
	return victim
}

// owners counts the distinct owners holding a slot (for tests and
// benchmarks: it reads every bucket).
func (t *localTable) owners() int {
	seen := map[uint64]bool{}
	for b := range t.heads {
		t.heads[b].mu.Lock()
		for _, s := range t.slots[b*bucketSlots : (b+1)*bucketSlots] {
			if s.owner != 0 {
				seen[s.owner] = true
			}
		}
		t.heads[b].mu.Unlock()
	}
	return len(seen)
}
