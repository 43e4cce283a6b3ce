package detect

import (
	"time"

	"quotaflow/services/alerter/internal/store"
)

// Thresholds are the percentages of a limit that raise quota.threshold,
// ascending.
var Thresholds = []int{80, 90, 100}

// step applies one snapshot of a limit (used of limit at time at, window
// resetting at resetAt, zero when unknown) to its state and returns the
// new state and the thresholds it crossed, ascending.
//
// Every threshold at or below st.Level is fired, every one above armed. A
// fired threshold t re-arms when the usage falls under t - hysteresis
// (percentage points), or when the window has reset. Snapshots carry no
// window start, so a reset is inferred: the snapshot comes at or after the
// reset time of the previous one and usage dropped by at least the
// hysteresis (at least 1 point). The drop requirement keeps a rolling
// window, whose reset time passes every time a bucket slides out, from
// re-firing on every trickle; a fixed window that reset and refilled past
// a threshold between two snapshots alerts again. Then
// each armed threshold the usage has reached fires, in order, so a jump
// from 70% to 100% fires 80, 90 and 100.
func step(st store.LimitState, used, limit int64, at, resetAt time.Time, hysteresis float64) (store.LimitState, []int) {
	pct := percent(used, limit)
	if st.Level > 0 && !st.ResetAt.IsZero() && !at.Before(st.ResetAt) &&
		percent(st.LastUsed, limit)-pct >= max(hysteresis, 1) {
		st.Level = 0 // the window reset
	}
	if st.Level > 0 && pct < float64(st.Level)-hysteresis {
		lvl := 0
		for _, t := range Thresholds {
			if t < st.Level && pct >= float64(t)-hysteresis {
				lvl = t
			}
		}
		st.Level = lvl
	}
	var fired []int
	for _, t := range Thresholds {
		if t > st.Level && pct >= float64(t) {
			fired = append(fired, t)
			st.Level = t
			st.Fires++
		}
	}
	st.LastUsed = used
	st.ResetAt = resetAt
	return st, fired
}

// percent is used/limit in percent; a limit of 0 or less is never reached.
func percent(used, limit int64) float64 {
	if limit <= 0 {
		return 0
	}
	return float64(used) * 100 / float64(limit)
}
