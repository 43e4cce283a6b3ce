package detect

import (
	"hash/maphash"
	"time"
)

// seen remembers the events counted in the rate windows, so that an event
// stored twice in the stream (a batch re-formed on retry: JetStream dedups
// messages, not the events inside them) counts once. It keeps an event
// only as long as it could count: until its time leaves the longest
// window (clamp ignores older events), so its memory is the events of one
// window, 16 bytes each in the map. Ids are kept as 64-bit hashes: two
// events of one window colliding (odds about n²/2⁶⁵, 2e-8 for a million)
// would count one of them once too few in a rate. Not safe for concurrent
// use: Detector holds mu.
type seen struct {
	seed maphash.Seed
	at   map[uint64]int64 // id hash -> the event's Unix second
}

func newSeen() seen { return seen{seed: maphash.MakeSeed(), at: map[uint64]int64{}} }

// first reports whether the event id of time at is new, remembering it.
func (s *seen) first(id string, at time.Time) bool {
	h := maphash.String(s.seed, id)
	if _, ok := s.at[h]; ok {
		return false
	}
	s.at[h] = at.Unix()
	return true
}

// prune forgets the events whose time lies before from.
func (s *seen) prune(from time.Time) {
	f := from.Unix()
	for h, sec := range s.at {
		if sec < f {
			delete(s.at, h)
		}
	}
}
