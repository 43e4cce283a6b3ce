package wire

import (
	"strconv"
	"testing"
	"time"

	"quotaflow/pkg/limits/policy"
)

// BenchmarkReserveBatch builds the reserve call of a batch of n requests
// of one tenant's users under a plan of five limits, as admission's batcher
// sends one under load (about 7 a batch at 16 connections, 25 at 64). The
// rules are resolved from a policy, as admission's are.
func BenchmarkReserveBatch(b *testing.B) {
	pol, err := policy.Parse([]byte(`
default_plan: five
plans:
  five:
    quotas:
      - {name: 5m, kind: rolling, window: 5m, limit: 1000000000}
      - {name: 1h, kind: rolling, window: 1h, limit: 1000000000}
      - {name: hour, kind: fixed, window: 1h, limit: 1000000000}
    rates: [{name: rps, kind: token_bucket, rate: 1000000, per: 1s, burst: 1000000}]
tenants:
  bench: {quotas: [{name: month, kind: fixed, window: 24h, limit: 1000000000000}]}
`))
	if err != nil {
		b.Fatal(err)
	}
	res, err := pol.Resolve("bench", "", "")
	if err != nil {
		b.Fatal(err)
	}
	rules := res.Subject
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
