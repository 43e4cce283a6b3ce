package events

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"quotaflow/pkg/ident"
)

// checker collects problems as "path: what is wrong", at most one per
// field. It is a small value: at and item derive checkers for nested
// fields without allocating, and paths are only built for problems.
type checker struct {
	st     *checkState
	prefix string // e.g. "data."
	list   string // for an element of a list: the list's field name
	idx    int    // and its index
}

type checkState struct {
	problems []string
	bad      map[string]bool // paths that already have a problem
	more     int             // problems beyond maxProblems
	// Problems found while reading, held back until the rules reach their
	// field, so the list follows field order.
	deferred     map[string]string
	deferredKeys []string
}

func newChecker() checker { return checker{st: &checkState{}} }

// at returns a checker for the fields under prefix (e.g. "data.").
func (c checker) at(prefix string) checker {
	return checker{st: c.st, prefix: c.prefix + prefix}
}

// item returns a checker for the fields of element i of list.
func (c checker) item(list string, i int) checker {
	return checker{st: c.st, prefix: c.prefix, list: list, idx: i}
}

func (c checker) path(field string) string {
	if c.list == "" {
		return c.prefix + field
	}
	return c.prefix + c.list + "[" + strconv.Itoa(c.idx) + "]." + field
}

// add records a problem with field unless it already has one.
func (c checker) add(field, problem string) {
	st, path := c.st, c.path(field)
	if st.bad == nil {
		st.bad = map[string]bool{}
	}
	if st.bad[path] {
		return
	}
	st.bad[path] = true
	if len(st.problems) == maxProblems {
		st.more++
		return
	}
	st.problems = append(st.problems, path+": "+problem)
}

// deferProblem records a problem found while reading field; it is
// reported when a rule reaches the field (pending) or at the end.
func (c checker) deferProblem(field, problem string) {
	st, path := c.st, c.path(field)
	if st.deferred == nil {
		st.deferred = map[string]string{}
	}
	if _, dup := st.deferred[path]; !dup {
		st.deferred[path] = problem
		st.deferredKeys = append(st.deferredKeys, path)
	}
}

// pending reports the problem held back for field, if any, and says
// whether there was one: the field's own rules then have nothing to add.
func (c checker) pending(field string) bool {
	if len(c.st.deferred) == 0 {
		return false
	}
	p, ok := c.st.deferred[c.path(field)]
	if ok {
		c.add(field, p)
	}
	return ok
}

// pendingItem is pending for element i of list as a whole.
func (c checker) pendingItem(list string, i int) bool {
	if len(c.st.deferred) == 0 {
		return false
	}
	return c.pending(list + "[" + strconv.Itoa(i) + "]")
}

func (c checker) err() error {
	st := c.st
	for _, path := range st.deferredKeys {
		checker{st: st}.add(path, st.deferred[path])
	}
	if len(st.problems) == 0 {
		return nil
	}
	msg := strings.Join(st.problems, "; ")
	if st.more > 0 {
		msg += fmt.Sprintf("; and %d more", st.more)
	}
	return fmt.Errorf("%w: %s", ErrInvalid, msg)
}

func (c checker) equal(field, v, want string) {
	if !c.pending(field) && v != want {
		c.add(field, fmt.Sprintf("must be %q", want))
	}
}

// ident checks an identifier by the rule every boundary applies (package
// ident), so that a consumer never stores what admission would refuse.
func (c checker) ident(field, v string, required bool) {
	switch {
	case c.pending(field):
	case v == "" && required:
		c.add(field, "required")
	default:
		if err := ident.Check(v); err != nil {
			c.add(field, err.Error())
		}
	}
}

// eventID checks the CloudEvent id, which travels as the Nats-Msg-Id
// header: printable ASCII without spaces.
func (c checker) eventID(field, v string) {
	switch {
	case c.pending(field):
	case v == "":
		c.add(field, "required")
	case len(v) > MaxID:
		c.add(field, fmt.Sprintf("longer than %d bytes", MaxID))
	default:
		for i := 0; i < len(v); i++ {
			if v[i] <= ' ' || v[i] > '~' {
				c.add(field, "must be printable ASCII without spaces")
				return
			}
		}
	}
}

func (c checker) count(field string, v, min int64) {
	switch {
	case c.pending(field):
	case v < min:
		c.add(field, fmt.Sprintf("must be >= %d", min))
	case v > MaxCount:
		c.add(field, fmt.Sprintf("must be <= %d", int64(MaxCount)))
	}
}

func (c checker) version(field string, v int64) {
	switch {
	case c.pending(field):
	case v < 0:
		c.add(field, "must be >= 0")
	case v > MaxVersion:
		c.add(field, fmt.Sprintf("must be <= %d", int64(MaxVersion)))
	}
}

func (c checker) signed(field string, v int64) {
	if !c.pending(field) && (v < -MaxCount || v > MaxCount) {
		c.add(field, fmt.Sprintf("must be between %d and %d", int64(-MaxCount), int64(MaxCount)))
	}
}

func (c checker) time(field string, t time.Time) {
	switch {
	case c.pending(field):
	case t.IsZero():
		c.add(field, "required")
	case t.Year() < 1 || t.Year() > 9999:
		c.add(field, "year must be between 1 and 9999")
	}
}

func (c checker) ip(field, v string) {
	switch {
	case c.pending(field), v == "":
	case len(v) > MaxID:
		c.add(field, fmt.Sprintf("longer than %d bytes", MaxID))
	default:
		if _, err := netip.ParseAddr(v); err != nil {
			c.add(field, "not an IP address")
		}
	}
}

// oneOf checks that v is one of want ("" among them makes it optional).
func (c checker) oneOf(field, v string, want ...string) {
	if c.pending(field) || slices.Contains(want, v) {
		return
	}
	quoted := make([]string, 0, len(want))
	for _, w := range want {
		if w != "" {
			quoted = append(quoted, strconv.Quote(w))
		}
	}
	c.add(field, "must be one of "+strings.Join(quoted, ", "))
}

func (c checker) scope(field, v string) {
	switch {
	case c.pending(field), v == "ip", v == "global", v == "tenant", v == "user":
	case v == "":
		c.add(field, "required")
	default:
		c.add(field, `must be "ip", "global", "tenant" or "user"`)
	}
}

func (c checker) unit(field, v string) {
	switch {
	case c.pending(field), v == "tokens", v == "requests":
	case v == "":
		c.add(field, "required")
	default:
		c.add(field, `must be "tokens" or "requests"`)
	}
}

func (c checker) limits(field string, ls []LimitState) {
	if c.pending(field) {
		return
	}
	for i, l := range ls {
		if c.pendingItem(field, i) {
			continue
		}
		ic := c.item(field, i)
		ic.scope("scope", l.Scope)
		ic.ident("name", l.Name, true)
		ic.ident("endpoint", l.Endpoint, false)
		ic.unit("unit", l.Unit)
		ic.count("limit", l.Limit, 0)
		ic.count("used", l.Used, 0)
		ic.signed("remaining", l.Remaining)
		ic.count("reset_seconds", l.ResetSeconds, 0)
	}
}

func (c checker) refs(field string, rs []LimitRef) {
	if c.pending(field) {
		return
	}
	for i, r := range rs {
		if c.pendingItem(field, i) {
			continue
		}
		ic := c.item(field, i)
		ic.scope("scope", r.Scope)
		ic.ident("name", r.Name, true)
		ic.ident("endpoint", r.Endpoint, false)
	}
}
