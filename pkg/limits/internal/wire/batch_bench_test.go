package wire

import (
	"strconv"
	"testing"
	"time"

	"quotaflow/pkg/limits/policy"
)

// BenchmarkReserveBatch builds the reserve call of a batch of n requests
// of one tenant's users under a plan of five limits, as admission's batcher
// sends one under load (about 7 a batch at 16 connections, 25 at 64).
func BenchmarkReserveBatch(b *testing.B) {
	hour := policy.Duration(time.Hour)
	rules := []policy.Rule{
		{Scope: policy.ScopeUser, Limit: policy.Limit{Name: "5m", Kind: policy.Rolling, Limit: 1e9, Window: policy.Duration(5 * time.Minute)}},
		{Scope: policy.ScopeUser, Limit: policy.Limit{Name: "1h", Kind: policy.Rolling, Limit: 1e9, Window: hour}},
		{Scope: policy.ScopeUser, Limit: policy.Limit{Name: "hour", Kind: policy.Fixed, Limit: 1e9, Window: hour}},
		{Scope: policy.ScopeUser, Limit: policy.Limit{Name: "rps", Kind: policy.TokenBucket, Rate: 1e6, Per: policy.Duration(time.Second), Burst: 1e6}},
		{Scope: policy.ScopeTenant, Limit: policy.Limit{Name: "month", Kind: policy.Fixed, Limit: 1e12, Window: policy.Duration(24 * time.Hour)}},
	}
	p := NewParams(time.Minute, false, 0)
	for _, n := range []int{1, 7, 25} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			users := make([]string, n)
			ids := make([]string, n)
			for i := range users {
				users[i], ids[i] = "u"+strconv.Itoa(i), "r"+strconv.Itoa(i)
			}
			b.ReportAllocs()
			for b.Loop() {
				rb := p.NewReserveBatch()
				for i := range n {
					if err := rb.Add("bench", users[i], ids[i], 10, ModeReserve, 1, 2, rules); err != nil {
						b.Fatal(err)
					}
				}
				_ = rb.Call()
			}
		})
	}
}
