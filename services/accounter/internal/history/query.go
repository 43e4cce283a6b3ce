package history

import (
	"net/url"
	"strconv"
	"time"

	"quotaflow/internal/alertlog"
)

// Step is a history's bucket: a UTC hour or a UTC day.
type Step string

// The steps of a history.
const (
	Hour Step = "hour"
	Day  Step = "day"
)

// duration is the length of one bucket of s.
func (s Step) duration() time.Duration {
	if s == Day {
		return 24 * time.Hour
	}
	return time.Hour
}

// The bounds of a query (docs/design.md §6): a range holds at most
// MaxPoints buckets of its step, and a list at most MaxLimit rows a page.
// A page's bounds are the alerter's (alertlog), so that it accepts every
// page of alerts the accounter forwards.
const (
	MaxPoints    = 744 // 31 days of hours; 744 days of days
	DefaultLimit = alertlog.DefaultLimit
	MaxLimit     = alertlog.MaxLimit
)

// Range is a time range [From, To) cut into buckets of Step. From is
// rounded down to the start of its bucket (UTC), To up to the end of its.
type Range struct {
	From, To time.Time
	Step     Step
}

// buckets returns the start of every bucket of r.
func (r Range) buckets() []time.Time {
	d := r.Step.duration()
	var out []time.Time
	for t := r.From; t.Before(r.To); t = t.Add(d) {
		out = append(out, t)
	}
	return out
}

// ParseRange reads from, to and step (default def) from q: RFC 3339 times,
// from before to, at most MaxPoints buckets once rounded to the step.
func ParseRange(q url.Values, def Step) (Range, error) {
	var r Range
	var err error
	if r.From, err = parseTime(q, "from"); err != nil {
		return r, err
	}
	if r.To, err = parseTime(q, "to"); err != nil {
		return r, err
	}
	switch s := Step(q.Get("step")); s {
	case "":
		r.Step = def
	case Hour, Day:
		r.Step = s
	default:
		return r, &ParamError{"step", "want hour or day"}
	}
	if !r.From.Before(r.To) {
		return r, &ParamError{"to", "must be after from"}
	}
	d := r.Step.duration()
	r.From = r.From.UTC().Truncate(d) // UTC hours and days: Truncate counts from the zero time, a UTC midnight
	if to := r.To.UTC().Truncate(d); !to.Equal(r.To) {
		r.To = to.Add(d)
	} else {
		r.To = to
	}
	if n := r.To.Sub(r.From) / d; n > MaxPoints {
		return r, &ParamError{"to", "the range holds " + strconv.Itoa(int(n)) + " " + string(r.Step) + "s; at most " + strconv.Itoa(MaxPoints)}
	}
	return r, nil
}

func parseTime(q url.Values, param string) (time.Time, error) {
	v := q.Get(param)
	if v == "" {
		return time.Time{}, &ParamError{param, "required (RFC 3339)"}
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil || t.Year() < 2000 || t.Year() > 9999 {
		return time.Time{}, &ParamError{param, "not an RFC 3339 time (2006-01-02T15:04:05Z)"}
	}
	return t, nil
}

// Page is a list's page: at most Limit rows after the first Offset.
type Page struct {
	Limit, Offset int
}

// MaxOffset bounds a page's offset: deeper pages would make Postgres count
// through rows it throws away.
const MaxOffset = alertlog.MaxOffset

// ParsePage reads limit (default DefaultLimit, at most MaxLimit) and offset
// (at most MaxOffset) from q.
func ParsePage(q url.Values) (Page, error) {
	p := Page{Limit: DefaultLimit}
	var err error
	if v := q.Get("limit"); v != "" {
		if p.Limit, err = strconv.Atoi(v); err != nil || p.Limit < 1 || p.Limit > MaxLimit {
			return p, &ParamError{"limit", "want 1 to " + strconv.Itoa(MaxLimit)}
		}
	}
	if v := q.Get("offset"); v != "" {
		if p.Offset, err = strconv.Atoi(v); err != nil || p.Offset < 0 || p.Offset > MaxOffset {
			return p, &ParamError{"offset", "want 0 to " + strconv.Itoa(MaxOffset)}
		}
	}
	return p, nil
}

// ParseThreshold reads threshold from q: a required percentage, 1 to 100.
func ParseThreshold(q url.Values) (int, error) {
	v, err := strconv.Atoi(q.Get("threshold"))
	if err != nil || v < 1 || v > 100 {
		return 0, &ParamError{"threshold", "want a percentage, 1 to 100"}
	}
	return v, nil
}
