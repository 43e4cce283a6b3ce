package policy

import "time"

// DefaultAlerts are the percentages a limit alerts at when its policy
// leaves alerts out and its kind alerts by default (AlertThresholds).
var DefaultAlerts = []int{80, 90, 100}

// alertsFrom is the shortest window of a request limit that alerts by
// default: a shorter one refills within minutes and would re-fire all day.
const alertsFrom = time.Hour

// AlertThresholds returns the percentages of the limit at which the
// alerter raises quota.threshold, ascending: Alerts when set (possibly
// empty), else the default by kind. Token limits alert at DefaultAlerts,
// and so do request limits of kind fixed, rolling and sliding_log with a
// window of an hour or more, and calendar_month ones. token_bucket and
// concurrency limits, whose refills and releases would re-fire all day,
// and shorter request windows alert at nothing unless set. The slice is
// shared: do not modify it.
func (l *Limit) AlertThresholds() []int {
	if l.Alerts != nil {
		return l.Alerts
	}
	switch {
	case l.Kind == TokenBucket || l.Kind == Concurrency:
		return nil
	case l.Unit == Tokens || l.Kind == CalendarMonth:
		return DefaultAlerts
	case (l.Kind == Fixed || l.Kind == Rolling || l.Kind == SlidingLog) && time.Duration(l.Window) >= alertsFrom:
		return DefaultAlerts
	}
	return nil
}

// alerts checks a limit's alerts: integers 1 to 100, ascending, each once.
func (c *policyChecker) alerts(path string, list []int) {
	for i, t := range list {
		switch {
		case t < 1 || t > 100:
			c.add(indexPath(path, i), "%d is not a percentage from 1 to 100", t)
		case i > 0 && t <= list[i-1]:
			c.add(indexPath(path, i), "%d after %d: list the percentages ascending, each once", t, list[i-1])
		}
	}
}
