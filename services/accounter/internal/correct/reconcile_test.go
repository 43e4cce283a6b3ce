package correct

import (
	"testing"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/ledger"
)

func TestExpected(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 30, 0, 0, time.UTC)
	us := []ledger.Usage{
		{At: time.Date(2026, 10, 31, 23, 0, 0, 0, time.UTC), Tokens: 1}, // last month
		{At: now.Add(-5 * time.Hour), Tokens: 10},                       // the 5h window's oldest bucket
		{At: now.Add(-4 * time.Hour), Tokens: 100},
		{At: now.Add(-20 * time.Minute), Tokens: 1000}, // this hour's fixed window
	}
	rolling := limits.Rule{Limit: limits.Limit{Kind: limits.Rolling, Window: limits.Duration(5 * time.Hour), Buckets: 24}}
	fixed := limits.Rule{Limit: limits.Limit{Kind: limits.Fixed, Window: limits.Duration(time.Hour)}}
	month := limits.Rule{Limit: limits.Limit{Kind: limits.CalendarMonth}}
	for _, tc := range []struct {
		name   string
		r      limits.Rule
		lo, hi int64
	}{
		{"rolling: exact to one bucket", rolling, 1100, 1110},
		{"fixed: this window", fixed, 1000, 1000},
		{"calendar month: since the 1st", month, 1110, 1110},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if lo, hi := expected(us, &tc.r, now); lo != tc.lo || hi != tc.hi {
				t.Errorf("expected(%s) = %d, %d; want %d, %d", tc.r.Kind, lo, hi, tc.lo, tc.hi)
			}
		})
	}
}
