package decide

import (
	"hash/maphash"
	"log/slog"
	"math"
	"sync"
	"time"
)

// localTable holds the local state: records of an owner's limits, in a
// fixed array allocated once at its cap, without a pointer, so that the
// garbage collector never scans it (with 100k subjects remembered it is most
// of admission's live memory, and scanning it was most of the collector's
// work) and it never grows.
//
// It is set-associative: an owner's records all live in one bucket of
// bucketRecs, chosen by the owner's hash, under that bucket's mutex, which
// makes a local decision over an owner's limits all-or-nothing. A record
// holds the owner's hash once and recLimits limits' states; an owner with
// more limits takes more records of its bucket. A record needed when its
// bucket is full takes the least recently used one, whichever owner it
// belongs to: the table forgets the least recently used records of an
// owner's neighbours first, with O(bucketRecs) work and no list. A record
// used within the current hold of its bucket's lock is never taken, so the
// slots of one decision stay its own while it holds the lock; past
// bucketSlots limits in one decision, the rest are decided from a fresh
// state, as for an owner forgotten.
//
// A record's generation counts the owners it has held, so that a spending
// is given back only to the state it was taken from, not to one of the same
// owner and limit created there since (a give-back would wrap it only after
// 2³² new owners of that record within one request).
//
// Owners are kept by a 64-bit hash of their key, not the key: the table
// holds no strings (a request's tenant and user do not outlive it). Two
// owners whose hashes collide (odds about n²/2⁶⁵ for n owners) share their
// local state, which only matters while Redis is unavailable.
type localTable struct {
	heads   []bucketHead
	buckets []bucket
}

const (
	// recLimits is the limits a record holds: a subject's token quotas in
	// the benchmarks' five-limit plan, which sizes the table
	// (Options.LocalEntries owners of one record each).
	recLimits = 3
	// bucketRecs is the associativity: a lookup compares this many owner
	// hashes (two cache lines) and a full bucket takes the least recently
	// used of as many records. 16 keeps 90 % of the owners when as many as
	// the table is sized for are active, 8 kept 86 % (BenchmarkRemember).
	bucketRecs = 16
	// bucketSlots is the most limits one owner keeps.
	bucketSlots = bucketRecs * recLimits
)

type bucketHead struct {
	mu    sync.Mutex
	clock uint16 // the current hold of mu, stamped on the records it uses
}

// bucket is bucketRecs records, field by field so that a lookup reads the
// owners' hashes together: 1,584 bytes, 99 a record, 33 a limit.
// Slot s of the table (a limit's state) is in bucket s/bucketSlots, its
// record s%bucketSlots/recLimits, its limit s%recLimits.
type bucket struct {
	owner [bucketRecs]uint64 // the record's owner's hash; 0: free
	st    [bucketRecs][recLimits]packedState
	id    [bucketRecs][recLimits]uint32 // the limit's stateID; 0: free
	gen   [bucketRecs]uint32            // the owners the record has held
	used  [bucketRecs]uint16            // the hold of the bucket's lock that last used it
	seen  [bucketRecs]uint8             // bit l: limit l's left came from Redis (ruleState.seen)
}

// packedState is a ruleState as the table keeps it, 24 bytes.
type packedState struct {
	left float64
	// t is, for a share, ruleState.t; for a quota, ruleState.t in ms
	// (rounded up, though Redis reports its resets in whole ms; 42 bits hold
	// 139 years) << owedBits | ruleState.owedAt.
	t    uint64
	owed [2]float32
}

// owner names an owner's bucket and hash in a localTable.
type owner struct {
	b int
	h uint64
}

// newLocalTable returns a table for entries owners; log hears of a
// fallback to the heap.
func newLocalTable(entries int, log *slog.Logger) *localTable {
	n := max(1, (entries+bucketRecs-1)/bucketRecs)
	t := &localTable{heads: make([]bucketHead, n)}
	t.alloc(n, log)
	return t
}

// onHeap allocates n buckets on the heap.
func (t *localTable) onHeap(n int) { t.buckets = make([]bucket, n) }

// owner returns the handle of k.
func (t *localTable) owner(k ownerKey) owner {
	h := maphash.Comparable(hashSeed, k)
	if h == 0 { // 0 marks a free record
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

// index returns the slot of o's state id, and whether it is fresh (its
// state the zero ruleState): a free slot of one of o's records, else the
// first of a free or the least recently used record of its bucket, or -1
// when every record of the bucket was used within this hold of its lock;
// caller holds o's bucket. A slot stays o's until the lock is released.
func (t *localTable) index(o owner, id uint32) (slot int, fresh bool) {
	clock := t.heads[o.b].clock
	bk := &t.buckets[o.b]
	base := o.b * bucketSlots
	free, victim, age := -1, -1, uint16(0)
	for r := range bucketRecs {
		if bk.owner[r] == o.h {
			for l, x := range bk.id[r] {
				if x == id {
					bk.used[r] = clock
					return base + r*recLimits + l, false
				}
				if x == 0 && free < 0 {
					free = r*recLimits + l
				}
			}
		}
		// Ages count holds of the lock modulo 2¹⁶: a record unused for
		// longer may look recent, which only makes it a later victim.
		a := clock - bk.used[r]
		if bk.owner[r] == 0 {
			a = ^uint16(0)
		}
		if a > age || (victim < 0 && a > 0) {
			victim, age = r, a
		}
	}
	if free >= 0 { // a record's free slots hold the zero state
		r := free / recLimits
		bk.id[r][free%recLimits], bk.used[r] = id, clock
		return base + free, true
	}
	if victim < 0 {
		return -1, false
	}
	bk.owner[victim], bk.gen[victim], bk.used[victim] = o.h, bk.gen[victim]+1, clock
	bk.id[victim], bk.st[victim], bk.seen[victim] = [recLimits]uint32{id}, [recLimits]packedState{}, 0
	return base + victim*recLimits, true
}

// at returns the bucket, record and limit of slot s.
func (t *localTable) at(s int) (*bucket, int, int) {
	r := s % bucketSlots
	return &t.buckets[s/bucketSlots], r / recLimits, r % recLimits
}

// gen returns the generation of slot s's record.
func (t *localTable) gen(s int) uint32 {
	bk, r, _ := t.at(s)
	return bk.gen[r]
}

// load returns the state kept in slot s, a quota's or a share's; caller
// holds its bucket.
func (t *localTable) load(s int, quota bool) ruleState {
	bk, r, l := t.at(s)
	p := &bk.st[r][l]
	st := ruleState{left: p.left, owed: p.owed, init: true}
	if !quota {
		st.t = int64(p.t)
		return st
	}
	st.t, st.owedAt = int64(p.t>>owedBits)*int64(time.Millisecond), uint32(p.t&owedMask)
	st.seen = bk.seen[r]&(1<<l) != 0
	return st
}

// store keeps st in slot s (see packedState for what it rounds); caller
// holds its bucket.
func (t *localTable) store(s int, quota bool, st *ruleState) {
	bk, r, l := t.at(s)
	p := &bk.st[r][l]
	p.left, p.owed = st.left, st.owed
	if !quota {
		p.t = uint64(st.t)
		return
	}
	ms := uint64(0)
	if st.t > 0 {
		ms = min(math.MaxUint64>>owedBits, uint64((st.t+int64(time.Millisecond)-1)/int64(time.Millisecond)))
	}
	p.t = ms<<owedBits | uint64(st.owedAt)
	if st.seen {
		bk.seen[r] |= 1 << l
	} else {
		bk.seen[r] &^= 1 << l
	}
}

// owners counts the distinct owners holding a record (for tests and
// benchmarks: it reads every bucket).
func (t *localTable) owners() int {
	seen := map[uint64]bool{}
	for b := range t.heads {
		t.heads[b].mu.Lock()
		for _, h := range t.buckets[b].owner {
			if h != 0 {
				seen[h] = true
			}
		}
		t.heads[b].mu.Unlock()
	}
	return len(seen)
}
