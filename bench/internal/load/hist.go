package load

import (
	"math/bits"
	"time"
)

// subBits sets the histogram's precision: 2^subBits buckets per power of
// two, so a bucket is at most 1/64 (1.6 %) of its values wide, as an HDR
// histogram of two significant digits.
const subBits = 6

// buckets covers every int64 count of nanoseconds.
const buckets = (64 - subBits) << subBits

// Histogram counts latencies in fixed log-linear buckets: recording is an
// index computation and an increment, with no allocation. Its zero value is
// empty and ready; it is not safe for concurrent use (Run keeps one per
// connection and merges them).
type Histogram struct {
	counts [buckets]uint64
	n      uint64
	max    time.Duration
}

func bucket(v uint64) int {
	if v < 1<<subBits {
		return int(v)
	}
	e := bits.Len64(v) - subBits - 1 // v>>e has subBits+1 bits
	return (e+1)<<subBits + int(v>>e) - 1<<subBits
}

// lowest is the smallest value bucket i holds; bucket i+1 starts where it
// ends.
func lowest(i int) uint64 {
	if i < 1<<subBits {
		return uint64(i)
	}
	e := i>>subBits - 1
	return uint64(i&(1<<subBits-1)+1<<subBits) << e
}

// Record counts one latency; negative ones count as zero.
func (h *Histogram) Record(d time.Duration) {
	d = max(d, 0)
	h.counts[bucket(uint64(d))]++
	h.n++
	h.max = max(h.max, d)
}

// Merge adds o's counts to h.
func (h *Histogram) Merge(o *Histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// Count is how many latencies were recorded.
func (h *Histogram) Count() uint64 { return h.n }

// Max is the largest latency recorded, exactly.
func (h *Histogram) Max() time.Duration { return h.max }

// Quantile returns the latency below which a fraction q (0..1) of the
// recorded ones lie: the upper end of the bucket holding it, so it errs
// high by at most a bucket's width, never above Max. 0 when empty.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q * float64(h.n))
	rank = min(max(rank, 1), h.n) // the rank-th smallest, 1-based
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return min(time.Duration(lowest(i+1)-1), h.max)
		}
	}
	return h.max
}
