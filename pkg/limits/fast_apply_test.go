package limits_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// TestFastPathStoresAsTheGeneralPath runs what the fast paths store, where
// limits.CheckFast runs only their decisions: every random reserve and
// settle goes to two tenants in one call (one Redis time), one on the fast
// paths, its twin on the general path alone (limits.GeneralFor), and after
// each step the replies, every blob's and record's bytes and every key's
// expiry must agree (a record's to 100 ms: its PX is set at call time).
// On one node a batch is one call, whatever tenants its entries name.
// Windows of seconds and refills by the second make the fast paths meet
// every case often. QF_MODEL_SEED replays a run.
func TestFastPathStoresAsTheGeneralPath(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	_, rng, _, offset := modelRun(t, c, 23)
	base := redistest.UniqueName(t)
	ta, tb := base+"-fast", base+"-general"
	// prepaid balances, user and tenant, topped up in the fast twin and copied to the other
	credits := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance}),
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "tcredits", Kind: policy.Balance}),
	}
	// the fast path's limits, and windows of seconds and refills by the second
	fastRules := append(append(fastPathRules(), credits...),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "r4", Kind: policy.Rolling, Limit: 300, Window: policy.Duration(4 * time.Second), Buckets: 4}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "f2", Kind: policy.Fixed, Limit: 250, Window: policy.Duration(2 * time.Second)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tps2", Kind: policy.TokenBucket, Rate: 77, Per: policy.Duration(time.Second), Burst: 150}))
	otherRules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 15, Window: policy.Duration(time.Hour)}),
	}
	pick := func() []policy.Rule { return pickRules(rng, fastRules, otherRules) }
	users := []string{"u1", "u2", "u3"}
	var open []openRequest
	at := func(off time.Duration) *limits.Limiter {
		return limits.New(c, limits.GeneralFor(limits.Options{NoEpochGuard: true, ClockOffset: off}, tb))
	}
	l := at(offset)
	type uid struct{ user, id string }
	var touched []uid
	type stored struct {
		val    string
		expiry time.Duration
	}
	// blob is the key of a user's blob ("": the tenant's)
	blob := func(tenant, user string) string {
		if user == "" {
			return "q{" + tenant + "}t"
		}
		return "q{" + tenant + "}u:" + user
	}
	dump := func(tenant string) map[string]stored {
		keys := []string{blob(tenant, "")}
		for _, u := range users {
			keys = append(keys, blob(tenant, u))
		}
		for _, x := range touched {
			keys = append(keys, "q{"+tenant+"}r:"+x.user+":"+x.id)
		}
		m := map[string]stored{}
		for _, k := range keys {
			v, _ := c.Get(ctx, k).Result()
			e, _ := c.PExpireTime(ctx, k).Result()
			m[strings.Replace(k, tenant, "T", 1)] = stored{fmt.Sprintf("%x", v), e}
		}
		return m
	}
	compare := func(step int) {
		a, b := dump(ta), dump(tb)
		for k := range a {
			// a record's PX is counted from when its SET runs: the twins' may be ms apart
			d, slack := a[k].expiry-b[k].expiry, time.Duration(0)
			if strings.HasPrefix(k, "q{T}r:") {
				slack = 100 * time.Millisecond
			}
			if a[k].val != b[k].val || d > slack || d < -slack {
				t.Fatalf("step %d: key %s differs:\nfast:    %+v\ngeneral: %+v", step, k, a[k], b[k])
			}
		}
		touched = touched[:0]
	}
	for step := range 1500 {
		switch r := rng.IntN(12); {
		case r == 0:
			offset += time.Duration(1+rng.IntN(6)) * 24 * time.Hour
		case r < 3:
			offset += time.Duration(1+rng.IntN(90)) * time.Minute
		case r < 6:
			offset += time.Duration(rng.IntN(1500)) * time.Millisecond
		case r == 6:
			offset -= time.Duration(1+rng.IntN(40)) * time.Minute
		}
		l = at(offset)
		if rng.IntN(4) == 0 {
			// Top-ups take neither path: the fast twin's is copied to the
			// general twin, bytes and expiry. Two top-ups would be two
			// calls, whose versions differ when they straddle a millisecond.
			r, user, amount := &credits[rng.IntN(len(credits))], users[rng.IntN(len(users))], 1+rng.Int64N(1500)
			if _, err := l.TopUp(ctx, ta, user, r, amount, "top-"+strconv.Itoa(step)); err != nil {
				t.Fatalf("step %d, top-up: %v", step, err)
			}
			owner := user
			if r.Scope == policy.ScopeTenant {
				owner = ""
			}
			copyKey(ctx, t, c, blob(ta, owner), blob(tb, owner))
		}
		if len(open) > 0 && rng.IntN(2) == 0 {
			var ops []limits.SettleOp
			for range 1 + rng.IntN(min(len(open), 5)) {
				i := rng.IntN(len(open))
				h := open[i]
				open = append(open[:i], open[i+1:]...)
				actual := rng.Int64N(400)
				if rng.IntN(6) == 0 {
					actual = 0
				}
				rel := rng.IntN(6) == 0
				touched = append(touched, uid{h.user, h.id})
				for _, tn := range []string{ta, tb} {
					ops = append(ops, limits.SettleOp{Settle: limits.Settle{Tenant: tn, User: h.user, RequestID: h.id,
						Rules: h.rules, Actual: actual}, Release: rel})
				}
			}
			out := l.SettleMany(ctx, ops)
			for k := 0; k < len(out); k += 2 {
				sa, sb := out[k].Settlement, out[k+1].Settlement
				sa.States, sb.States = noRules(sa.States), noRules(sb.States)
				sameTwins(t, step, "settle", k, sa, sb, out[k].Err, out[k+1].Err)
			}
		}
		var rs []limits.Request
		for k := range 1 + rng.IntN(6) {
			id := "s" + strconv.Itoa(step) + "-" + strconv.Itoa(k)
			if len(open) > 0 && rng.IntN(10) == 0 {
				id = open[rng.IntN(len(open))].id
			}
			cost := rng.Int64N(300)
			if rng.IntN(10) == 0 {
				cost = 0
			}
			user, rules := users[rng.IntN(len(users))], pick()
			touched = append(touched, uid{user, id})
			for _, tn := range []string{ta, tb} {
				rs = append(rs, limits.Request{Tenant: tn, User: user, RequestID: id, Cost: cost, Rules: rules, Fingerprint: cost + 1, Nonce: int64(step)})
			}
		}
		out := l.ReserveBatch(ctx, rs)
		for k := 0; k < len(out); k += 2 {
			da, db := out[k].Decision, out[k+1].Decision
			da.States, db.States = noRules(da.States), noRules(db.States)
			sameTwins(t, step, "reserve", k, da, db, out[k].Err, out[k+1].Err)
			if d := out[k].Decision; d.Allowed && !d.Duplicate {
				open = append(open, openRequest{rs[k].User, rs[k].RequestID, rs[k].Rules})
			}
		}
		compare(step)
	}
}

// copyKey sets key to to from's value and expiry.
func copyKey(ctx context.Context, t *testing.T, c *redis.Client, from, to string) {
	t.Helper()
	v, err := c.Get(ctx, from).Result()
	if err != nil {
		t.Fatal(err)
	}
	e, err := c.PExpireTime(ctx, from).Result()
	if err != nil {
		t.Fatal(err)
	}
	args := []any{"SET", to, v}
	if e > 0 {
		args = append(args, "PXAT", e.Milliseconds())
	}
	if err := c.Do(ctx, args...).Err(); err != nil {
		t.Fatal(err)
	}
}

// noRules returns ss without their rules (pointers, which differ between
// twins).
func noRules(ss []limits.State) []limits.State {
	out := make([]limits.State, len(ss))
	for i, s := range ss {
		s.Rule = nil
		out[i] = s
	}
	return out
}

// sameTwins fails the test unless twin outcomes a and b (the fast path's
// and the general path's) and their errors agree.
func sameTwins(t *testing.T, step int, what string, k int, a, b any, ea, eb error) {
	t.Helper()
	if fa, fb := fmt.Sprintf("%+v %v", a, ea), fmt.Sprintf("%+v %v", b, eb); fa != fb {
		t.Fatalf("step %d %s %d:\nfast:    %s\ngeneral: %s", step, what, k, fa, fb)
	}
}
