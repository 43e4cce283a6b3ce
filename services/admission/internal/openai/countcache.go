package openai

import (
	"hash/maphash"
	"sync"
)

// Bounds of the count cache.
const (
	// cacheSlots × 16 bytes is an encoding's cache: 256 KiB.
	cacheSlots = 1 << 14
	// minCached is the shortest text remembered: a shorter one costs a few
	// microseconds to count, and would crowd out the long ones.
	minCached = 64
)

// countCache remembers the token counts of texts of one encoding, by a
// 64-bit hash of the text: a conversation sends its whole history again
// each turn, so most of a request's text was counted before. It is
// direct-mapped, so its memory is fixed and a new text evicts the one in
// its slot; a wrong count needs two texts with the same 64-bit hash under
// a seed chosen at start. Safe for concurrent use.
type countCache struct {
	seed  maphash.Seed
	mu    sync.Mutex
	slots []cacheSlot
}

type cacheSlot struct {
	hash   uint64
	tokens int64 // 0: empty (a text of minCached bytes has tokens)
}

func newCountCache() *countCache {
	return &countCache{seed: maphash.MakeSeed(), slots: make([]cacheSlot, cacheSlots)}
}

func (c *countCache) get(h uint64) (int64, bool) {
	c.mu.Lock()
	s := c.slots[h%cacheSlots]
	c.mu.Unlock()
	return s.tokens, s.tokens > 0 && s.hash == h
}

func (c *countCache) put(h uint64, tokens int64) {
	c.mu.Lock()
	c.slots[h%cacheSlots] = cacheSlot{h, tokens}
	c.mu.Unlock()
}
