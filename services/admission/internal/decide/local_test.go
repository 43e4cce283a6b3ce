package decide

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// localDecider is a Decider with only its local state, for pure logic.
func localDecider(t testing.TB, o Options) *Decider {
	t.Helper()
	o, err := o.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return &Decider{opt: o, local: newLocalCache(o.LocalEntries), epoch: time.Now()}
}

func rule(scope policy.Scope, unit policy.Unit, l policy.Limit) policy.Rule {
	l.Unit = unit
	return policy.Rule{Limit: l, Scope: scope}
}

// check decides rules locally for one owner entry.
func check(d *Decider, e *entry, rules []policy.Rule, cost int64) (int, time.Duration, limits.Reason, []LimitState) {
	out := make([]LimitState, len(rules))
	var spends []localSpend
	e.mu.Lock()
	defer e.mu.Unlock()
	i, retry, reason := d.localCheck([2]*entry{e, e}, rules, cost, d.mono(), out, &spends)
	return i, retry, reason, out
}

func TestLocalShare(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{Instances: 4})
		rules := []policy.Rule{rule(policy.ScopeGlobal, policy.Requests, policy.Limit{Name: "m", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Minute)})}
		e := &entry{}
		for i := range 25 { // 100 / 4 instances
			if di, _, _, _ := check(d, e, rules, 1); di >= 0 {
				t.Fatalf("request %d denied, want the share of 25 allowed", i+1)
			}
		}
		di, retry, reason, out := check(d, e, rules, 1)
		if di != 0 || reason != limits.ReasonNone || retry < 2400*time.Millisecond || retry > 2401*time.Millisecond || out[0].Remaining != 0 || out[0].Used != 25 {
			t.Fatalf("26th = denied %d, retry %v, reason %q, %+v; want denied, one unit in 2.4s, 25 used (this instance's)", di, retry, reason, out[0])
		}
		time.Sleep(retry)
		if di, _, _, _ := check(d, e, rules, 1); di >= 0 {
			t.Fatal("denied after the share refilled a unit")
		}
	})
}

func TestLocalQuotaFromLastSeen(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{UnseenAllowance: 50})
		r := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})
		rules := []policy.Rule{r}
		d.remember("acme", "seen", []limits.State{{Rule: &rules[0], Limit: 100, Used: 70, Remaining: 30, Reset: 10 * time.Minute}}, d.mono())
		seen := d.local.get(ownerKey{scope: policy.ScopeUser, a: "acme", b: "seen"}, false)
		if seen == nil {
			t.Fatal("remember kept nothing")
		}
		if di, _, _, out := check(d, seen, rules, 20); di >= 0 || out[0].Remaining != 10 || out[0].Used != 90 {
			t.Fatalf("cost 20 of 30 seen: denied %d, %+v; want allowed, 90 used, 10 left", di, out[0])
		}
		di, retry, _, _ := check(d, seen, rules, 20)
		if di != 0 || retry != 10*time.Minute {
			t.Fatalf("cost 20 of 10 left: denied %d, retry %v; want denied until the window resets", di, retry)
		}
		time.Sleep(10 * time.Minute)
		if di, _, _, out := check(d, seen, rules, 20); di >= 0 || out[0].Remaining != 80 {
			t.Fatalf("after the reset: denied %d, %+v; want the full limit back", di, out[0])
		}

		// Never seen: the allowance, which does not refill. Used is what
		// this instance spent, not the limit minus the allowance: nobody
		// knows the rest, and alerts must not read it as usage.
		unseen := d.local.get(ownerKey{scope: policy.ScopeUser, a: "acme", b: "new"}, true)
		if di, _, _, out := check(d, unseen, rules, 10); di >= 0 || out[0].Used != 10 || out[0].Remaining != 40 {
			t.Fatalf("cost 10 of an unseen subject's 50: denied %d, %+v; want allowed, 10 used, 40 left", di, out[0])
		}
		if di, _, _, _ := check(d, unseen, rules, 40); di >= 0 {
			t.Fatal("unseen subject denied within its allowance")
		}
		if di, _, _, _ := check(d, unseen, rules, 1); di != 0 {
			t.Fatal("unseen subject allowed past its allowance")
		}
		// A cost above the limit itself can never fit.
		if _, retry, reason, _ := check(d, unseen, rules, 101); reason != limits.ReasonCostExceedsLimit || retry != 0 {
			t.Fatalf("cost 101 of a limit of 100: reason %q retry %v, want cost_exceeds_limit", reason, retry)
		}
	})
}

func TestLocalAllOrNothingAndShadow(t *testing.T) {
	d := localDecider(t, Options{UnseenAllowance: 10}) // capped by each limit
	shadow := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "s", Kind: policy.Fixed, Limit: 5, Window: policy.Duration(time.Hour), Shadow: true})
	big := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "big", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})
	rate := rule(policy.ScopeUser, policy.Requests, policy.Limit{Name: "r", Kind: policy.Fixed, Limit: 1, Window: policy.Duration(time.Hour)})
	rules := []policy.Rule{shadow, big, rate}
	e := &entry{}

	di, _, _, out := check(d, e, rules, 8)
	if di >= 0 || !out[0].WouldDeny {
		t.Fatalf("first = denied %d, shadow %+v; want allowed with the shadow limit would-deny", di, out[0])
	}
	// The request limit denies: the token limits keep their 2 left.
	if di, _, _, _ := check(d, e, rules, 1); di != 2 {
		t.Fatalf("second denied by %d, want the request limit (2)", di)
	}
	if st := e.state(stateID(&rules[1])); st.left != 2 {
		t.Fatalf("big left = %v after a denial, want 2 (nothing spent)", st.left)
	}
}

func TestLocalCacheIsBounded(t *testing.T) {
	c := newLocalCache(1024)
	hot := ownerKey{scope: policy.ScopeUser, a: "t", b: "hot"}
	for i := range 100_000 {
		c.get(ownerKey{scope: policy.ScopeUser, a: "t", b: fmt.Sprint(i)}, true)
		if i%100 == 0 {
			c.get(hot, true)
		}
	}
	if n := c.len(); n > 1024 {
		t.Fatalf("cache holds %d entries, want at most 1024", n)
	}
	if c.get(hot, false) == nil {
		t.Fatal("a recently used entry was evicted")
	}
	if c.get(ownerKey{scope: policy.ScopeUser, a: "t", b: "0"}, false) != nil {
		t.Fatal("the oldest entry is still there")
	}
}
