package detect

import "time"

// window counts two quantities (a, b) per second over a sliding span: a
// map from Unix second to counts, pruned as time passes. Its memory is at
// most one entry per second of the span. Not safe for concurrent use.
type window struct {
	sec map[int64][2]int64
}

func (w *window) add(at time.Time, a, b int64) {
	if w.sec == nil {
		w.sec = map[int64][2]int64{}
	}
	s := at.Unix()
	c := w.sec[s]
	c[0] += a
	c[1] += b
	w.sec[s] = c
}

// sum returns the totals of the seconds in (now - span, now] and drops
// older ones.
func (w *window) sum(now time.Time, span time.Duration) (a, b int64) {
	from := now.Add(-span).Unix()
	for s, c := range w.sec {
		if s <= from {
			delete(w.sec, s)
			continue
		}
		a += c[0]
		b += c[1]
	}
	return a, b
}

func (w *window) empty() bool { return len(w.sec) == 0 }
