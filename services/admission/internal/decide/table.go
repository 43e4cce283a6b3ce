package decide

import (
	"hash/maphash"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"
)

// localTable holds the local state: limit states of owners, in a fixed
// array allocated once at its cap, without a pointer, so that the garbage
// collector never scans it (with 100k subjects remembered it is most of
// admission's live memory, and scanning it was most of the collector's
// work) and it never grows.
//
// It is set-associative: an owner's states all live in one bucket, chosen
// by the owner's hash, under that bucket's mutex, which makes a local
// decision over an owner's limits all-or-nothing. A bucket holds up to
// bucketOwners owners' hashes once each and bucketSlots limit states, each
// state tagged with its owner's place: an owner takes as many states as it
// has limits, one for an IP's, four for a user of the benchmarks' plan. A
// state or owner needed when its bucket has none free takes those of the
// least recently used owner, whichever it is: the table forgets the least
// recently used of an owner's neighbours first, with O(bucketOwners +
// bucketSlots) work and no list. An owner used within the current hold of
// its bucket's lock is never forgotten, so the states of one decision stay
// its own while it holds the lock, and its own states are never taken
// for another of its limits: an owner's limits past bucketSlots are not
// kept (localCheck denies by them).
//
// A slot's generation counts the states it has let go, so that a spending
// is given back only to the state it was taken from, not to a free slot or
// to a state created there since (a give-back would wrap it only after 2³²
// states of that slot forgotten within one request).
//
// Owners are kept by a 64-bit hash of their key, not the key: the table
// holds no strings (a request's tenant and user do not outlive it). Two
// owners whose hashes collide (odds about n²/2⁶⁵ for n owners) share their
// local state, which only matters while Redis is unavailable.
type localTable struct {
	heads   []bucketHead
	buckets []bucket
	mapped  []byte // buckets' memory when mapped outside the heap (table_mmap.go)
}

const (
	// bucketEntries is how many of Options.LocalEntries a bucket stands
	// for: an entry is three limits' states (a subject's token quotas in
	// the benchmarks' five-limit plan) and two owners.
	bucketEntries = 16
	// bucketSlots is the limit states of a bucket, and the most one owner
	// keeps; bucketOwners the owners it holds at once. A lookup compares
	// bucketOwners hashes (four cache lines) and the states' tags (one).
	bucketSlots  = bucketEntries * 3
	bucketOwners = bucketEntries * 2
	// tagOwner is the bits of a state's tag naming its owner's place + 1
	// (0: free); tagSeen is ruleState.seen.
	tagOwner = 0x3f
	tagSeen  = 0x80
)

type bucketHead struct {
	mu    sync.Mutex
	clock uint16 // the current hold of mu, stamped on the owners it uses
}

// bucket is bucketOwners owners and bucketSlots states, field by field so
// that a lookup reads the owners' hashes together: 1,904 bytes, 119 an
// entry (bucketEntries), 33 a state and 10 an owner.
// Slot s of the table (a limit's state) is in bucket s/bucketSlots, place
// s%bucketSlots.
type bucket struct {
	owner [bucketOwners]uint64 // the owner's hash; 0: free
	used  [bucketOwners]uint16 // the hold of the bucket's lock that last used it
	st    [bucketSlots]packedState
	id    [bucketSlots]uint32 // the limit's stateID
	gen   [bucketSlots]uint32 // the states the slot has let go
	tag   [bucketSlots]uint8  // its owner's place + 1 (0: free) | tagSeen
}

// packedState is a ruleState as the table keeps it, 24 bytes.
type packedState struct {
	left float64
	// t is, for a quota, ruleState.t in ms of the monotonic clock, rounded
	// up (up to 1 ms after Redis's boundary, which the reply's latency
	// already delays: bring keeps what is owed across it; 42 bits hold 139
	// years) << owedBits | ruleState.owedAt; for a share, ruleState.t.
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
	n := max(1, (entries+bucketEntries-1)/bucketEntries)
	t := &localTable{heads: make([]bucketHead, n)}
	t.alloc(n, log)
	return t
}

// onHeap allocates n buckets on the heap.
func (t *localTable) onHeap(n int) { t.buckets = make([]bucket, n) }

// hashSeed hashes owners' keys.
var hashSeed = maphash.MakeSeed()

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
// state the zero ruleState): o's state, else a free slot, taking o a free
// place if it has none, after forgetting the least recently used owners
// while either is missing; -1 when every owner left in the bucket was used
// within this hold of its lock; caller holds o's bucket. A slot stays o's
// until the lock is released.
func (t *localTable) index(o owner, id uint32) (slot int, fresh bool) {
	clock := t.heads[o.b].clock
	bk := &t.buckets[o.b]
	base := o.b * bucketSlots
	me, place := -1, -1
	for p, h := range bk.owner {
		if h == o.h {
			me = p
			break
		}
		if h == 0 && place < 0 {
			place = p
		}
	}
	if me >= 0 {
		bk.used[me] = clock // kept while this decision takes more slots
		for i, g := range bk.tag {
			if int(g&tagOwner) == me+1 && bk.id[i] == id {
				return base + i, false
			}
		}
	}
	free := slices.Index(bk.tag[:], 0)
	for free < 0 || (me < 0 && place < 0) {
		v := t.victim(o.b)
		if v < 0 {
			return -1, false
		}
		// Missing a slot, take one state of the victim, and its place once
		// it has none left; missing only a place, take all its states.
		one, kept := free < 0, 0
		for i := len(bk.tag) - 1; i >= 0; i-- {
			if int(bk.tag[i]&tagOwner) != v+1 {
				continue
			}
			if !one || free < 0 {
				bk.tag[i], bk.gen[i], free = 0, bk.gen[i]+1, max(free, i)
			} else {
				kept++
			}
		}
		if kept == 0 {
			bk.owner[v] = 0
			place = max(place, v)
		}
	}
	if me < 0 {
		me = place
		bk.owner[me], bk.used[me] = o.h, clock
	}
	bk.st[free], bk.id[free], bk.tag[free] = packedState{}, id, uint8(me+1)
	return base + free, true
}

// victim returns the place of bucket b's least recently used owner, or -1
// when each was used within the current hold of its lock.
func (t *localTable) victim(b int) int {
	clock := t.heads[b].clock
	bk := &t.buckets[b]
	v, age := -1, uint16(0)
	for p, h := range bk.owner {
		// Ages count holds of the lock modulo 2¹⁶: an owner unused for
		// longer may look recent, which only makes it a later victim.
		if a := clock - bk.used[p]; h != 0 && a > age {
			v, age = p, a
		}
	}
	return v
}

// at returns the bucket and place of slot s.
func (t *localTable) at(s int) (*bucket, int) {
	return &t.buckets[s/bucketSlots], s % bucketSlots
}

// gen returns the generation of slot s.
func (t *localTable) gen(s int) uint32 {
	bk, i := t.at(s)
	return bk.gen[i]
}

// load returns the state kept in slot s, a quota's or a share's; caller
// holds its bucket.
func (t *localTable) load(s int, quota bool) ruleState {
	bk, i := t.at(s)
	p := &bk.st[i]
	st := ruleState{left: p.left, owed: p.owed, init: true}
	if !quota {
		st.t = int64(p.t)
		return st
	}
	st.t, st.owedAt = int64(p.t>>owedBits)*int64(time.Millisecond), uint32(p.t&owedMask)
	st.seen = bk.tag[i]&tagSeen != 0
	return st
}

// store keeps st in slot s (see packedState for what it rounds); caller
// holds its bucket.
func (t *localTable) store(s int, quota bool, st *ruleState) {
	bk, i := t.at(s)
	p := &bk.st[i]
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
		bk.tag[i] |= tagSeen
	} else {
		bk.tag[i] &^= tagSeen
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
