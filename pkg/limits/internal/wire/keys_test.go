package wire

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"quotaflow/pkg/limits/policy"
)

// A limit's record id is stored in every blob in Redis: if the hash changed,
// an upgrade would make every user's usage vanish. These ids were computed
// by the original implementation.
func TestRuleIDsAreStableAcrossReleases(t *testing.T) {
	for _, c := range []struct {
		rule policy.Rule
		want int64
	}{
		{policy.Rule{Limit: policy.Limit{Name: "tokens_5h", Kind: policy.Rolling, Window: policy.Duration(5 * time.Hour)}, Scope: policy.ScopeUser}, 0x6c96957575c7},
		{policy.Rule{Limit: policy.Limit{Name: "tokens_30d", Kind: policy.Rolling, Window: policy.Duration(30 * 24 * time.Hour), Buckets: 30}, Scope: policy.ScopeTenant}, 0xa01d522440e9},
		{policy.Rule{Limit: policy.Limit{Name: "rpm", Kind: policy.Fixed, Window: policy.Duration(time.Minute)}, Scope: policy.ScopeGlobal, Endpoint: "/v1/chat"}, 0xa2d187ef7433},
		{policy.Rule{Limit: policy.Limit{Name: "burst", Kind: policy.TokenBucket}, Scope: policy.ScopeUser}, 0xae987ce68de6},
		{policy.Rule{Limit: policy.Limit{Name: "log", Kind: policy.SlidingLog, Window: policy.Duration(time.Second)}, Scope: policy.ScopeIP}, 0xbb0f996e7b97},
	} {
		if got := c.rule.ID(); got != c.want {
			t.Errorf("ID of %s = %#x, want %#x", c.rule.Name, got, c.want)
		}
	}
}

func TestKeysOfATenantShareItsHashTag(t *testing.T) {
	for _, tenant := range []string{"acme", "{x}", "a}b{c", "%7B", ":::", "é"} {
		k := NewSubjectKeys(tenant, "u:{1}")
		r := policy.Rule{Limit: policy.Limit{Name: "in}flight"}, Scope: policy.ScopeUser, Endpoint: "/{v1}"}
		tr := policy.Rule{Limit: policy.Limit{Name: "month"}, Scope: policy.ScopeTenant}
		keys := []string{k.Blob(), k.TenantBlob(), k.Reservation("r:{2}"), k.Concurrency(&r), k.Concurrency(&tr), k.TopUp("ref}")}
		want := hashTag(keys[0])
		if want != esc(tenant) {
			t.Errorf("tag of %q = %q, want %q", tenant, want, esc(tenant))
		}
		for _, key := range keys {
			if got := hashTag(key); got != want {
				t.Errorf("hashTag(%q) = %q, want %q", key, got, want)
			}
		}
		if Slot(hashTag(epochKey(want))) != Slot(want) {
			t.Errorf("epoch key of %q is in another slot", tenant)
		}
	}
}

// TestSubjectCallKeys checks the keys a subject call names, which it cuts
// from one string, against the key layout, escaped identifiers included.
func TestSubjectCallKeys(t *testing.T) {
	for _, c := range []struct {
		tenant, user, requestID string
		want                    [4]string
	}{
		{"acme", "u1", "r1", [4]string{"", "q{acme}r:u1:r1", "q{acme}u:u1", "q{acme}t"}},
		{"a}b", "u:{1}", "r:%2", [4]string{"", "q{a%7Db}r:u%3A%7B1%7D:r%3A%252", "q{a%7Db}u:u%3A%7B1%7D", "q{a%7Db}t"}},
		{"acme", "u1", "", [4]string{"", "", "q{acme}u:u1", "q{acme}t"}},
	} {
		k := NewSubjectKeys(c.tenant, c.user)
		keys, _ := subjectCallKeys(k, c.requestID, nil)
		c.want[0] = epochKey(k.Tag())
		if len(keys) != 4 || [4]string(keys) != c.want {
			t.Errorf("subjectCallKeys(%q, %q, %q) = %q, want %q", c.tenant, c.user, c.requestID, keys, c.want)
		}
		if c.requestID != "" && k.Reservation(c.requestID) != c.want[1] || k.Blob() != c.want[2] || k.TenantBlob() != c.want[3] {
			t.Errorf("keys of (%q, %q, %q) = %q, %q, %q, want %q", c.tenant, c.user, c.requestID,
				k.Reservation(c.requestID), k.Blob(), k.TenantBlob(), c.want[1:])
		}
	}
}

// hashTag applies Redis Cluster's rule: the bytes between the first '{' and
// the next '}', when not empty.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// TestCounterKeys pins the counters' key layout (keys.go), checks that a
// counter's slot and epoch key are its key's, and that a key costs one
// allocation, the string (a script call names a key per counter).
func TestCounterKeys(t *testing.T) {
	rule := func(scope policy.Scope) *policy.Rule {
		return &policy.Rule{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Limit: 5, Window: policy.Duration(24 * time.Hour)}, Scope: scope, Endpoint: "e"}
	}
	n := func(r *policy.Rule) string { return strconv.FormatInt(r.ID(), 36) }
	user, tenantWide, global, ip := rule(policy.ScopeUser), rule(policy.ScopeTenant), rule(policy.ScopeGlobal), rule(policy.ScopeIP)
	for _, c := range []struct {
		c    Counter
		want string
	}{
		{Counter{Scope: policy.ScopeUser, Tenant: "a:b", ID: "u{1}", Rule: user}, "q{a%3Ab}c:u%7B1%7D:" + n(user)},
		{Counter{Scope: policy.ScopeTenant, Tenant: "acme", ID: "u", Rule: tenantWide}, "q{acme}C:" + n(tenantWide)},
		{Counter{Scope: policy.ScopeGlobal, ID: "t4:acmeu3:bobc0f", Rule: global}, "q{%gt4%3Aacmeu3%3Abobc0f}c" + n(global)},
		{Counter{Scope: policy.ScopeIP, ID: "10.0.0.1", Rule: ip}, "q{%i10.0.0.1}c" + n(ip)},
		{Counter{Scope: policy.ScopeGlobal, Tenant: "acme", ID: "t4:acmeu3:bobc0f", Rule: global}, "q{acme}g:t4%3Aacmeu3%3Abobc0f:" + n(global)},
		{Counter{Scope: policy.ScopeIP, Tenant: "acme", ID: "10.0.0.1", Rule: ip}, "q{acme}i:10.0.0.1:" + n(ip)},
	} {
		if err := CheckCounter(&c.c); err != nil {
			t.Fatalf("CheckCounter(%+v) = %v", c.c, err)
		}
		key := c.c.Key()
		if key != c.want {
			t.Errorf("Key(%+v) = %q, want %q", c.c, key, c.want)
		}
		if slot := Slot(hashTag(key)); c.c.Slot() != slot || Slot(hashTag(SlotEpochKey(slot))) != slot {
			t.Errorf("%s: Slot() = %d, its key's %d, its epoch key's %d", key, c.c.Slot(), slot, Slot(hashTag(SlotEpochKey(slot))))
		}
		if a := testing.AllocsPerRun(100, func() { _ = c.c.Key() }); a != 1 {
			t.Errorf("Key(%+v) makes %v allocations, want 1", c.c, a)
		}
		if a := testing.AllocsPerRun(100, func() { _ = SlotEpochKey(c.c.Slot()) }); a != 0 {
			t.Errorf("its epoch key makes %v allocations, want 0", a)
		}
	}
}

// Every slot's epoch key names that slot, and the keys stay those of
// earlier releases (Redis holds them).
func TestSlotEpochKeys(t *testing.T) {
	for slot := range uint16(NumSlots) {
		k := SlotEpochKey(slot)
		tag, ok := strings.CutSuffix(strings.TrimPrefix(k, "qe{"), "}")
		if !ok || len(tag) == 0 || len(tag) > 4 || tag != hashTag(k) || Slot(tag) != slot {
			t.Fatalf("SlotEpochKey(%d) = %q, want qe{tag} of a 1-4 character tag of slot %d", slot, k, slot)
		}
	}
	for slot, want := range map[uint16]string{0: "qe{1bz}", 1: "qe{emj}", 12539: "qe{6f1}", NumSlots - 1: "qe{hia}"} {
		if got := SlotEpochKey(slot); got != want {
			t.Errorf("SlotEpochKey(%d) = %q, want %q", slot, got, want)
		}
	}
}
