package wire

import (
	"strconv"
	"strings"
	"sync"

	"quotaflow/pkg/limits/internal/hash48"
	"quotaflow/pkg/limits/policy"
)

// Key layout. Every key starts with "q" and a Redis Cluster hash tag:
//
//	q{T}u:U       blob of user U's limits (plan limits, endpoint per-user
//	              limits) and U's version, tenant T
//	q{T}t         blob of tenant T's tenant-wide limits and its version
//	q{T}r:U:R     reservation record of request R of user U
//	q{T}z:U:L     sorted set of user U's concurrency limit L (q{T}Z:L for a
//	              tenant-wide one)
//	q{T}b:R       marker of the balance top-up with reference R
//	q{%gE}        blob of endpoint E's global limits
//	q{%iA}        blob of client IP A's limits
//	q{%gE}cN      a CountBatch counter of endpoint E's fixed window N (ruleID
//	              in base 36; q{%iA}cN of client IP A's): window number and
//	              count, '<i6i6'
//	q{T}c:U:N     the counter of user U's fixed window of requests N, when
//	              every limit of U's plan is one (limits.Reserve); q{T}C:N
//	              of the tenant's tenant-wide one; laid out as the above
//	q{T}g:E:N     a CountBatch counter of endpoint E's fixed window N kept in
//	              tenant T's slot (limits.SharedRequest.Tenant; q{T}i:A:N
//	              of client IP A's); laid out as the above
//	qe{S}         epoch key of the cluster slot that tag S hashes to
//
// A blob holds the state of several limits, one record each, named by a
// 48-bit hash of the limit's identity (ruleID); see protocol.go.
//
// Identifiers are escaped (esc) so that no two different tenants, users,
// endpoints or request ids ever produce the same key, whatever characters
// they contain, and so that a tenant can never choose the tag of another
// tenant or of a shared scope: escaped text holds no '{', '}' or ':', and its
// '%' is always followed by two hex digits, so the "%g" and "%i" tags of the
// shared scopes cannot be spelled by a tenant.

// esc percent-escapes the bytes that carry meaning in a key.
func esc(s string) string {
	if !strings.ContainsAny(s, "%{}:") {
		return s
	}
	var buf [64]byte // one allocation, the string, when short
	return string(appendEsc(buf[:0], s))
}

// appendEsc appends s escaped as esc does.
func appendEsc(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '%':
			b = append(b, "%25"...)
		case '{':
			b = append(b, "%7B"...)
		case '}':
			b = append(b, "%7D"...)
		case ':':
			b = append(b, "%3A"...)
		default:
			b = append(b, c)
		}
	}
	return b
}

// unesc reverses esc.
func unesc(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	r := strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}", "%3A", ":")
	return r.Replace(s)
}

// SubjectKeys builds the keys of one (tenant, user).
type SubjectKeys struct {
	prefix string // q{T}
	user   string // escaped user
}

// NewSubjectKeys returns the keys of (tenant, user).
func NewSubjectKeys(tenant, user string) SubjectKeys {
	return SubjectKeys{prefix: "q{" + esc(tenant) + "}", user: esc(user)}
}

// Tag returns the hash tag's content, which decides the cluster slot.
func (k SubjectKeys) Tag() string { return k.prefix[2 : len(k.prefix)-1] }

// Blob is the subject's blob.
func (k SubjectKeys) Blob() string {
	var buf [128]byte
	return string(k.appendBlob(buf[:0]))
}

func (k SubjectKeys) appendBlob(b []byte) []byte {
	return append(append(append(b, k.prefix...), "u:"...), k.user...)
}

// TenantBlob is the blob of the tenant's tenant-wide limits.
func (k SubjectKeys) TenantBlob() string { return k.prefix + "t" }

func (k SubjectKeys) appendTenantBlob(b []byte) []byte { return append(append(b, k.prefix...), 't') }

// Reservation is the reservation record of requestID.
func (k SubjectKeys) Reservation(requestID string) string {
	var buf [192]byte
	return string(k.appendReservation(buf[:0], requestID))
}

func (k SubjectKeys) appendReservation(b []byte, requestID string) []byte {
	b = append(append(append(append(b, k.prefix...), "r:"...), k.user...), ':')
	return appendEsc(b, requestID)
}

// Concurrency returns the sorted set of a concurrency limit.
func (k SubjectKeys) Concurrency(r *policy.Rule) string {
	if r.Scope == policy.ScopeTenant {
		return k.prefix + "Z:" + limitPath(r)
	}
	return k.prefix + "z:" + k.user + ":" + limitPath(r)
}

// TopUp is the marker of the top-up with reference.
func (k SubjectKeys) TopUp(reference string) string {
	return k.prefix + "b:" + esc(reference)
}

// limitPath names a limit within its scope: endpoint limits carry their
// endpoint, so they never share a counter with a plan limit of that name.
func limitPath(r *policy.Rule) string {
	if r.Endpoint != "" {
		return "e:" + esc(r.Endpoint) + ":" + esc(r.Name)
	}
	return esc(r.Name)
}

// sharedTag returns the hash tag content of a shared (global or IP) scope.
// Each endpoint and each IP has its own tag, so a cluster spreads them.
func sharedTag(scope policy.Scope, id string) string {
	var buf [64]byte
	return string(appendSharedTag(buf[:0], scope, id))
}

// appendSharedTag appends sharedTag(scope, id).
func appendSharedTag(b []byte, scope policy.Scope, id string) []byte {
	return appendEsc(append(b, '%', sharedKind(scope)), id)
}

// sharedKind is the letter of a shared scope in its keys: i for an IP's,
// g for an endpoint's.
func sharedKind(scope policy.Scope) byte {
	if scope == policy.ScopeIP {
		return 'i'
	}
	return 'g'
}

// sharedBlob is the blob of the shared scope with tag.
func sharedBlob(tag string) string { return "q{" + tag + "}" }

// SubjectBlobPattern is the SCAN pattern of every subject and tenant blob
// (and of a few other keys, which SubjectOf rejects).
const SubjectBlobPattern = "q{*}[ut]*"

// SubjectOf returns the tenant and user of a subject blob's key (user ""
// for a tenant blob), and false for any other key.
func SubjectOf(key string) (tenant, user string, ok bool) {
	tag, rest, ok := tagOf(key)
	if !ok || strings.HasPrefix(tag, "%g") || strings.HasPrefix(tag, "%i") {
		return "", "", false // a shared scope's tag, which no escaped tenant spells
	}
	switch {
	case rest == "t":
	case strings.HasPrefix(rest, "u:") && len(rest) > 2:
		user = unesc(rest[2:])
	default:
		return "", "", false
	}
	return unesc(tag), user, true
}

// StateKeyPattern is the SCAN pattern of every key that holds state of a
// tenant or a shared scope (all but the epoch keys).
const StateKeyPattern = "q{*"

// SlotOfKey returns the cluster slot of a key that StateKeyPattern matches,
// and false for a key without a tag.
func SlotOfKey(key string) (uint16, bool) {
	tag, _, ok := tagOf(key)
	return Slot(tag), ok
}

// tagOf splits a key that opens with "q{" into its tag and the rest.
// Escaped text holds no '}', so the tag ends at the first one.
func tagOf(key string) (tag, rest string, ok bool) {
	end := strings.IndexByte(key, '}')
	if end < 0 {
		return "", "", false
	}
	return key[2:end], key[end+1:], true
}

// The epoch marks a Redis as holding quotaflow's state. A script may only
// touch keys of one cluster slot, and a cluster loses data one shard at a
// time, so there is one epoch key per slot (16384 small keys, about 1 MiB):
// the script of a tenant reads the epoch key of the tenant's slot, which
// says exactly whether that shard still holds its state. A single Redis
// node uses the same keys, so both run the same code.

// NumSlots is the number of Redis Cluster hash slots.
const NumSlots = 16384

var (
	epochKeysOnce sync.Once
	// epochKeys holds every slot's epoch key, in slot order, and
	// epochKeyEnd[slot] where the key of slot ends in it: one allocation
	// without pointers (114 kB) beside 64 kB of ends, not 16,384 strings
	// (256 kB of headers beside 215 kB of allocations, all resident, each
	// an object the collector marks on every cycle).
	epochKeys   string
	epochKeyEnd [NumSlots]uint32
)

// SlotEpochKey returns the epoch key of slot: "qe{", a short string whose
// hash slot is slot, and "}". The keys are built once by trying base-36
// strings, which covers every slot within 4 characters, and kept: every
// counter and reserve of a script call names one.
func SlotEpochKey(slot uint16) string {
	epochKeysOnce.Do(func() {
		var tags [NumSlots]string
		left, size := NumSlots, 0
		for i := 0; left > 0; i++ {
			s := strconv.FormatInt(int64(i), 36)
			h := crc16(s) % NumSlots
			if tags[h] == "" {
				tags[h] = s
				left, size = left-1, size+len("qe{}")+len(s)
			}
		}
		var b strings.Builder
		b.Grow(size)
		for slot, tag := range tags {
			b.WriteString("qe{")
			b.WriteString(tag)
			b.WriteString("}")
			epochKeyEnd[slot] = uint32(b.Len())
		}
		epochKeys = b.String()
	})
	start := uint32(0)
	if slot > 0 {
		start = epochKeyEnd[slot-1]
	}
	return epochKeys[start:epochKeyEnd[slot]]
}

// Slot is the cluster slot of hash tag content tag.
func Slot(tag string) uint16 { return crc16(tag) % NumSlots }

// TenantSlot is the cluster slot of every key of tenant.
func TenantSlot(tenant string) uint16 { return Slot(esc(tenant)) }

// SharedSlot returns the hash slot of the shared limits of scope's id.
func SharedSlot(scope policy.Scope, id string) uint16 { return Slot(sharedTag(scope, id)) }

// epochKey returns the epoch key of the slot of hash tag content tag.
func epochKey(tag string) string { return SlotEpochKey(Slot(tag)) }

// crc16 is the CRC16-CCITT (XMODEM) that Redis Cluster hashes keys with.
func crc16[T string | []byte](s T) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc = crc<<8 ^ crcTable[byte(crc>>8)^s[i]]
	}
	return crc
}

var crcTable = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()

// Fingerprint is limits.Fingerprint: a 48-bit hash of a request's
// endpoint, plan, model and cost.
func Fingerprint(endpoint, plan, model string, cost int64) int64 {
	h := hash48.New()
	h.Mix(endpoint)
	h.Mix(plan)
	h.Mix(model)
	h.MixInt(cost)
	return h.Sum()
}
