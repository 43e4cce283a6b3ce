package events

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"time"
)

// ID returns the deterministic event id of the event of type typ for
// request requestID of (tenant, user): the same request always yields the
// same id, so JetStream drops a retried publish as a duplicate, and no two
// different inputs share one (see HashID).
func ID(typ, tenant, user, requestID string) string {
	return HashID(typ, tenant, user, requestID)
}

// TopUpID returns the id of the top-up event of tenant with reference, the
// top-up's idempotency key (the user is not part of it).
func TopUpID(tenant, reference string) string {
	return HashID(TypeTopUp, tenant, reference)
}

// DeniedID returns the id of the denial aggregate d for the second that
// holds at, counted by origin: one id per (tenant, user, ip, endpoint,
// scope, name, Unix second, origin). Count is not part of it, so a
// republished aggregate dedups. Origin tells apart aggregates of one key
// and second that are each a share of the count: every publisher that
// aggregates on its own (each admission instance) needs its own, or the
// stream keeps the first count and drops the others as duplicates.
func DeniedID(d Denied, at time.Time, origin string) string {
	return HashID(TypeDenied, d.Tenant, d.User, d.IP, d.Endpoint, d.Scope, d.Name,
		strconv.FormatInt(at.Unix(), 10), origin)
}

// HashID is the lowercase hex of the first 16 bytes (128 bits) of the
// SHA-256 of the fields, each written as its length in bytes (8-byte
// big-endian) followed by its bytes. The length prefixes make the encoding
// injective, so ("a:b", "c") and ("a", "b:c") hash different inputs; the
// type comes first, which separates the kinds of id. 128 bits keep
// accidental collisions out of reach (birthday bound 2^64 events). Other
// deterministic ids of the project (the alerter's alert ids) derive the
// same way.
func HashID(fields ...string) string {
	h := sha256.New()
	var n [8]byte
	for _, f := range fields {
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		h.Write(n[:])
		h.Write([]byte(f))
	}
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])[:16])
}
