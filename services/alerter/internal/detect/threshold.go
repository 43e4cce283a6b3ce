package detect

import (
	"time"

	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/store"
)

// resets says what a limit's reset time (a snapshot's reset_seconds) means,
// by its kind (pkg/limits lib.lua report).
type resets int

const (
	// resetsGuessed: the kind is unknown (no policy read, or a limit the
	// policy does not define); a reset is guessed from a drop in usage.
	resetsGuessed resets = iota
	// resetsAtTime: at its reset time the limit holds nothing: a fixed or
	// calendar_month window ends, a token bucket is full again (or, at
	// rate 0, its allowance renews).
	resetsAtTime
	// resetsNever: the reset time is only when the oldest usage leaves
	// (a rolling window's oldest bucket, a sliding log's oldest request),
	// or there is none (balance, concurrency).
	resetsNever
)

// resetsOf returns what the reset time of a limit of kind k means.
func resetsOf(k policy.Kind) resets {
	switch k {
	case policy.Fixed, policy.CalendarMonth, policy.TokenBucket:
		return resetsAtTime
	case "":
		return resetsGuessed
	}
	return resetsNever
}

// step applies one snapshot of a limit (used of limit at time at, window
// resetting at resetAt, zero when unknown) to its state, under the limit's
// thresholds (percentages 1 to 100, ascending, possibly none), and returns
// the new state and the thresholds it crossed, ascending.
//
// The state's Level is the highest threshold fired and not re-armed: every
// threshold at or below it counts as fired, every one above it armed. It
// is a percentage, not an index, so it keeps its meaning when a policy
// reload changes the thresholds between two snapshots: usage was at least
// Level, so a new threshold under it is no news and one above it is armed.
// A fired threshold t re-arms when the usage falls under t - h, or when the
// window has reset, where h is the hysteresis in percentage points, at
// most half the level (a 4 % threshold could never re-arm under 4 - 5).
// Snapshots carry no window start, so a reset is inferred from the reset
// time of the previous snapshot, as rs says: with resetsAtTime the window
// reset if this snapshot comes at or after it, whatever the usage (a fixed
// window that reset and refilled past a threshold between two snapshots
// alerts again); with resetsNever never (a rolling window pinned near its
// limit passes its reset time every time a bucket slides out, and only
// hysteresis re-arms it); with resetsGuessed it reset if this snapshot
// comes at or after it and usage dropped by at least h (at least 1 point):
// a rolling window does not re-fire on every trickle, but does when a
// bucket of h points or more slides out, and a fixed window that refilled
// to its old usage does not alert again. Then each armed
// threshold the usage has reached fires, in order, so a jump from 70% to
// 100% under 80, 90 and 100 fires all three.
func step(st store.LimitState, used, limit int64, at, resetAt time.Time, thresholds []int, rs resets, hysteresis float64) (store.LimitState, []int) {
	pct := percent(used, limit)
	h := min(hysteresis, float64(st.Level)/2)
	if st.Level > 0 && !st.ResetAt.IsZero() && !at.Before(st.ResetAt) &&
		(rs == resetsAtTime || rs == resetsGuessed && percent(st.LastUsed, limit)-pct >= max(h, 1)) {
		st.Level = 0 // the window reset
	}
	if st.Level > 0 && pct < float64(st.Level)-h {
		lvl := 0
		for _, t := range thresholds {
			if t < st.Level && pct >= float64(t)-min(hysteresis, float64(t)/2) {
				lvl = t
			}
		}
		st.Level = lvl
	}
	var fired []int
	for _, t := range thresholds {
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
