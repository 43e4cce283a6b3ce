package wire

import (
	"testing"
	"time"

	"quotaflow/pkg/limits/policy"
)

type testState struct {
	Rule      *policy.Rule
	Limit     int64
	Used      int64
	Remaining int64
	Reset     time.Duration
	WouldDeny bool
}

// TestStatesReadsTheLimitsGoKnowsFromTheRules checks how a snapshot's
// limits decode: used and reset per limit, a balance's credited and a
// shadow limit's would-deny after them, every other limit from the rule
// (a token bucket's its burst), counts held to [0, MaxCost].
func TestStatesReadsTheLimitsGoKnowsFromTheRules(t *testing.T) {
	rules := []policy.Rule{
		{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(24 * time.Hour)}},
		{Limit: policy.Limit{Name: "rps", Kind: policy.TokenBucket, Burst: 50, Rate: 5, Per: policy.Duration(time.Second)}},
		{Limit: policy.Limit{Name: "credits", Kind: policy.Balance}},
		{Limit: policy.Limit{Name: "try", Kind: policy.Rolling, Limit: 10, Window: policy.Duration(time.Hour), Shadow: true}},
		{Limit: policy.Limit{Name: "big", Kind: policy.Fixed, Limit: 2 * MaxCost, Window: policy.Duration(time.Hour)}},
	}
	v := []int64{
		30, 1000, // day
		20, 4000, // rps
		7, 0, 40, // credits: spent, reset, credited
		12, 500, 1, // try: would deny
		-3, 9, // big
	}
	if n := limitValues(rules); n != len(v) {
		t.Fatalf("limitValues = %d, want %d", n, len(v))
	}
	want := []testState{
		{Limit: 100, Used: 30, Remaining: 70, Reset: time.Second},
		{Limit: 50, Used: 20, Remaining: 30, Reset: 4 * time.Second},
		{Limit: 40, Used: 7, Remaining: 33},
		{Limit: 10, Used: 12, Remaining: 0, Reset: 500 * time.Millisecond, WouldDeny: true},
		{Limit: MaxCost, Used: 0, Remaining: MaxCost, Reset: 9 * time.Millisecond},
	}
	for i, s := range States[testState](v, rules) {
		if s.Rule != &rules[i] {
			t.Errorf("state %d names another rule", i)
		}
		s.Rule = nil
		if s != want[i] {
			t.Errorf("state %d = %+v, want %+v", i, s, want[i])
		}
	}
}
