package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/policy"
)

// counterLen is the size of one counter of a count call's group
// ('<I2I2i6i6i6B').
const counterLen = 23

// MaxCountKeys bounds the keys of one count call: count.lua reads them
// with one MGET of unpack(KEYS), and Redis's Lua unpacks fewer than 8000
// values (LUAI_MAXCSTACK). A group brings at most two keys per counter
// (its key and its slot's epoch key).
const MaxCountKeys = 4000

// Counter is one fixed-window counter of a count call: Cost added to the
// counter of Rule (a fixed window) of Scope's ID. A shared counter's Scope
// is policy.ScopeGlobal or policy.ScopeIP; a subject's is its rule's,
// policy.ScopeTenant or policy.ScopeUser, of Tenant's user ID (a
// tenant-wide counter is the tenant's, whatever the user).
type Counter struct {
	Scope policy.Scope
	// Tenant is a subject counter's tenant, or the tenant whose hash slot
	// a shared counter is kept in (empty: the slot of its own id's tag).
	Tenant string
	ID     string
	Cost   int64
	Rule   *policy.Rule
}

// CheckCounter checks a counter's scope, identifiers, cost and rule.
func CheckCounter(c *Counter) error {
	var ids error
	switch c.Scope {
	case policy.ScopeGlobal, policy.ScopeIP:
		ids = errors.Join(checkID(string(c.Scope), c.ID, true), checkID("tenant", c.Tenant, false))
	case policy.ScopeTenant, policy.ScopeUser:
		ids = checkSubject(c.Tenant, c.ID)
		if c.Rule.Scope != c.Scope {
			ids = fmt.Errorf("%w: counter scope %q: rule %s is of scope %q", ErrInvalid, c.Scope, c.Rule.Name, c.Rule.Scope)
		}
	default:
		return fmt.Errorf("%w: counter scope %q: want global, ip, tenant or user", ErrInvalid, c.Scope)
	}
	r := c.Rule
	if err := errors.Join(ids, checkCost("cost", c.Cost), checkCost("limit", r.Limit.Limit)); err != nil {
		return err
	}
	if r.Kind != policy.Fixed || time.Duration(r.Window) < time.Millisecond {
		return fmt.Errorf("%w: counter %s: want a fixed window of at least 1ms, not %s of %v", ErrInvalid, r.Name, r.Kind, time.Duration(r.Window))
	}
	return nil
}

// appendTag appends the hash tag of c's key: its tenant's (so a subject's
// counters share the slot of its blobs and records, and a shared counter
// kept with a tenant that slot and its epoch key) or its shared scope's.
func (c *Counter) appendTag(b []byte) []byte {
	if c.Tenant != "" {
		return appendEsc(b, c.Tenant)
	}
	return appendSharedTag(b, c.Scope, c.ID)
}

// Key is c's key: the tag, then the rule's identity (ruleID), so a counter
// never shares the key of a blob, a record or another rule's counter. It
// is built on the stack: one allocation, the string.
func (c *Counter) Key() string {
	var buf [160]byte
	b := c.appendTag(append(buf[:0], "q{"...))
	switch {
	case c.Scope == policy.ScopeTenant:
		b = append(b, "}C:"...)
	case c.Scope == policy.ScopeUser:
		b = append(appendEsc(append(b, "}c:"...), c.ID), ':')
	case c.Tenant != "":
		b = append(appendEsc(append(b, '}', sharedKind(c.Scope), ':'), c.ID), ':')
	default:
		b = append(b, "}c"...)
	}
	return string(strconv.AppendInt(b, c.Rule.ID(), 36))
}

// Slot is the cluster slot of c's key.
func (c *Counter) Slot() uint16 {
	var buf [160]byte
	return crc16(c.appendTag(buf[:0])) % NumSlots
}

// CounterSlot is the cluster slot of every counter of shared scope's id.
func CounterSlot(scope policy.Scope, id string) uint16 { return SharedSlot(scope, id) }

// CheckSubjectCall checks the identifiers and cost of a subject's reserve
// or peek, whichever store holds its limits.
func CheckSubjectCall(tenant, user, requestID string, cost int64) error {
	return errors.Join(checkSubject(tenant, user), checkID("request_id", requestID, true), checkCost("cost", cost))
}

// CountBatch gathers groups of counters into one count call (count.lua):
// their keys, each once, and one argument per group. Build it with
// Params.NewCountBatch.
type CountBatch struct {
	batch
	groups []int // counters per group
}

// NewCountBatch returns an empty batch.
func (p Params) NewCountBatch() *CountBatch {
	b := &CountBatch{batch: p.newBatch()}
	b.args = b.args[:1]
	return b
}

// Len is the number of groups in b.
func (b *CountBatch) Len() int { return len(b.groups) }

// AdjustNow is the date of an adjustment made at Redis time.
const AdjustNow = -1

// Add adds a group of counters, checked (CheckCounter) by the caller: to
// charge all or none when at is zero, else an adjustment by each (signed)
// Cost dated at (Unix ms, or AdjustNow).
func (b *CountBatch) Add(at int64, cs []Counter) {
	w := make([]byte, 6+counterLen*len(cs))
	putInt48(w, at)
	for i := range cs {
		c := &cs[i]
		o := w[6+counterLen*i:]
		binary.LittleEndian.PutUint16(o[0:], uint16(b.key(SlotEpochKey(c.Slot()))))
		binary.LittleEndian.PutUint16(o[2:], uint16(b.key(c.Key())))
		putInt48(o[4:], c.Cost)
		putInt48(o[10:], c.Rule.Limit.Limit)
		putInt48(o[16:], time.Duration(c.Rule.Window).Milliseconds())
		if c.Rule.Shadow {
			o[22] = 1
		}
	}
	b.add(string(w))
	b.groups = append(b.groups, len(cs))
}

// Call returns the count call of b's groups.
func (b *CountBatch) Call() Call {
	var h [7]byte
	putInt48(h[0:], b.p.offset)
	h[6] = b.p.guard[0] - '0'
	b.args[0] = string(h[:])
	return Call{Keys: b.strs, Args: b.args, What: "count"}
}

// CountReply is one group of a count reply.
type CountReply struct {
	Status int64   // StatusAllowed, StatusDenied
	Seen   []int64 // per counter, the count it found (an adjustment's: after it)
}

// DecodeCount reads the reply of count call c of b and passes f each
// group's reply or error, in order; it returns
// the call's Redis time (µs). An error of the whole call, or a reply that
// is not exactly b's groups' (values missing or left over), is every
// group's; a group without its epoch gets ErrNoEpoch.
func DecodeCount(cmd *redis.Cmd, b *CountBatch, f func(i int, v CountReply, err error)) time.Time {
	v, err := cmd.Int64Slice()
	if err == nil && len(v) == 0 {
		err = errors.New("count: empty reply")
	}
	var now time.Time
	if err == nil {
		now = time.UnixMicro(v[0])
		v = v[1:]
		rest := v
		for i, k := range b.groups {
			switch {
			case len(rest) > 0 && rest[0] == -1:
				rest = rest[1:]
				continue
			case len(rest) < 1+k || rest[0] != StatusAllowed && rest[0] != StatusDenied:
				err = fmt.Errorf("count: malformed reply for group %d of %d counters", i, k)
			}
			if err != nil {
				break
			}
			rest = rest[1+k:]
		}
		if err == nil && len(rest) > 0 {
			err = fmt.Errorf("count: %d values past the reply's last group", len(rest))
		}
	}
	for i, k := range b.groups {
		switch {
		case err != nil:
			f(i, CountReply{}, err)
		case v[0] == -1:
			f(i, CountReply{}, ErrNoEpoch)
			v = v[1:]
		default:
			f(i, CountReply{Status: v[0], Seen: v[1 : 1+k : 1+k]}, nil)
			v = v[1+k:]
		}
	}
	return now
}
