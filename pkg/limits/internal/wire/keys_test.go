package wire

import (
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
		if got := ruleID(&c.rule); got != c.want {
			t.Errorf("ruleID(%s) = %#x, want %#x", c.rule.Name, got, c.want)
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
