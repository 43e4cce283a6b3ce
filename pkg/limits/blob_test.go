package limits_test

import (
	"context"
	"encoding/binary"
	"slices"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// blobRecord is one record of a blob as stored (lib.lua): the bytes from
// its header on, and its expiry.
type blobRecord struct {
	expires int64
	bytes   string
}

// blobOf reads key's blob and splits it into its records, failing the test
// unless they fill it exactly.
func blobOf(t *testing.T, key string) (version string, recs []blobRecord) {
	t.Helper()
	raw, err := redistest.Shared(t).Get(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	if len(raw) < 8 {
		t.Fatalf("blob of %d bytes", len(raw))
	}
	for p := 8; p < len(raw); {
		if p+14 > len(raw) {
			t.Fatalf("a record header past the blob's end at byte %d of %d", p, len(raw))
		}
		e := make([]byte, 8)
		copy(e, raw[p+6:p+12])
		end := p + 14 + int(binary.LittleEndian.Uint16([]byte(raw[p+12:p+14])))
		if end > len(raw) {
			t.Fatalf("a record past the blob's end: bytes %d to %d of %d", p, end, len(raw))
		}
		recs = append(recs, blobRecord{int64(binary.LittleEndian.Uint64(e)), raw[p:end]})
		p = end
	}
	return raw[:8], recs
}

// TestBlobWritesKeepOnlyLiveRecords checks what a blob holds after writes
// that change some of its records: a write in place (every record live,
// each changed one of its old length) rewrites only those and the version,
// and leaves the others' bytes as they were; a record that grew, or one
// that expired, makes the write a whole one, which drops what expired.
func TestBlobWritesKeepOnlyLiveRecords(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	second := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1s", Kind: policy.Fixed, Unit: policy.Requests, Limit: 100, Window: policy.Duration(time.Second)})
	hour := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})
	window := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})
	log := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 100, Window: policy.Duration(time.Hour)})
	day := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1d", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(24 * time.Hour)})
	key := wire.NewSubjectKeys(tenant, "u").Blob()
	// Redis time pinned half a second into an hour, so that the hour's
	// window does not turn over during the test.
	base := 500*time.Millisecond - time.Duration(time.Now().UnixNano()%int64(time.Hour))
	at := func(d time.Duration) time.Duration { return base + d }

	all := []policy.Rule{second, hour, window, log, day}
	limitstest.Reserve(t, limitstest.At(c, at(0)), tenant, "u", "r1", 3, all)
	v1, before := blobOf(t, key)
	if len(before) != 5 {
		t.Fatalf("after a reserve over 5 limits the blob holds %d records, want 5", len(before))
	}

	// the rolling window (the middle record) changes alone: in place
	limitstest.Reserve(t, limitstest.At(c, at(10*time.Millisecond)), tenant, "u", "r2", 4, []policy.Rule{window})
	v2, after := blobOf(t, key)
	if len(after) != 5 || v2 == v1 {
		t.Fatalf("after a reserve over the middle limit: %d records, version changed %v; want 5, true", len(after), v2 != v1)
	}
	for i, r := range after {
		if changed := r.bytes != before[i].bytes; changed != (i == 2) {
			t.Errorf("record %d changed = %v, want %v", i, changed, i == 2)
		}
	}
	d := limitstest.Peek(t, limitstest.At(c, at(20*time.Millisecond)), tenant, "u", all)
	if got, want := limitstest.Used(d.States), []int64{1, 3, 7, 1, 3}; !slices.Equal(got, want) {
		t.Fatalf("used after the in-place write = %v, want %v", got, want)
	}

	// the log grows by an entry, the records after it move: a whole write
	limitstest.Reserve(t, limitstest.At(c, at(30*time.Millisecond)), tenant, "u", "r3", 2, []policy.Rule{log, day})
	if _, recs := blobOf(t, key); len(recs) != 5 || len(recs[3].bytes) != len(after[3].bytes)+6 {
		t.Fatalf("after the log grew: %d records, the log's %d bytes; want 5, %d", len(recs), len(recs[3].bytes), len(after[3].bytes)+6)
	}

	// two seconds on, the 1 s window's record expired: the next write,
	// of records that keep their length, drops it
	now := limitstest.Reserve(t, limitstest.At(c, at(2*time.Second)), tenant, "u", "r4", 5, []policy.Rule{hour, day}).Now.UnixMilli()
	_, recs := blobOf(t, key)
	if len(recs) != 4 {
		t.Fatalf("after the 1 s window expired the blob holds %d records, want 4", len(recs))
	}
	for i, r := range recs {
		if r.expires <= now {
			t.Errorf("record %d expired at %d, before the write at %d", i, r.expires, now)
		}
	}
	d = limitstest.Peek(t, limitstest.At(c, at(2*time.Second)), tenant, "u", all)
	if got, want := limitstest.Used(d.States), []int64{0, 8, 7, 2, 10}; !slices.Equal(got, want) {
		t.Fatalf("used after the whole write = %v, want %v", got, want)
	}
}

// TestBlobWritesAnExpiredRecordStoredAgainInPlace checks that a record
// which had expired when read and which the call stores again at its old
// length (a 1 s window an idle subject comes back to, a token bucket that
// refilled) is written in place, at its old position, beside the records
// that did not change: the write of a subject back after a pause is not a
// whole one (it was: the record moved to the blob's end).
func TestBlobWritesAnExpiredRecordStoredAgainInPlace(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	second := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1s", Kind: policy.Fixed, Unit: policy.Requests, Limit: 100, Window: policy.Duration(time.Second)})
	hour := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})
	window := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})
	key := wire.NewSubjectKeys(tenant, "u").Blob()
	base := 500*time.Millisecond - time.Duration(time.Now().UnixNano()%int64(time.Hour))
	at := func(d time.Duration) time.Duration { return base + d }

	all := []policy.Rule{second, hour, window}
	limitstest.Reserve(t, limitstest.At(c, at(0)), tenant, "u", "r1", 3, all)
	v1, before := blobOf(t, key)
	if len(before) != 3 {
		t.Fatalf("after a reserve over 3 limits the blob holds %d records, want 3", len(before))
	}

	// two seconds on, the 1 s window's record (the first) expired; this
	// reserve stores it again, and the hour's
	now := limitstest.Reserve(t, limitstest.At(c, at(2*time.Second)), tenant, "u", "r2", 4, []policy.Rule{second, hour}).Now.UnixMilli()
	v2, after := blobOf(t, key)
	if len(after) != 3 || v2 == v1 {
		t.Fatalf("after the expired record was stored again: %d records, version changed %v; want 3, true", len(after), v2 != v1)
	}
	for i, r := range after {
		if r.bytes[:6] != before[i].bytes[:6] {
			t.Errorf("record %d is another limit's: the records moved (a whole write)", i)
		}
		if changed := r.bytes != before[i].bytes; changed != (i < 2) {
			t.Errorf("record %d changed = %v, want %v", i, changed, i < 2)
		}
		if r.expires <= now {
			t.Errorf("record %d expires at %d, before the write at %d", i, r.expires, now)
		}
	}
	d := limitstest.Peek(t, limitstest.At(c, at(2*time.Second)), tenant, "u", all)
	if got, want := limitstest.Used(d.States), []int64{1, 7, 3}; !slices.Equal(got, want) {
		t.Fatalf("used after the in-place write = %v, want %v", got, want)
	}
}
