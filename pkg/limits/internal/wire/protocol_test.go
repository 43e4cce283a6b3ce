package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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

// packed packs vs as a snapshot reply element (little-endian int64s).
func packed(vs ...int64) string {
	b := make([]byte, 0, 8*len(vs))
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return string(b)
}

// TestDecodeReservesEntryByEntry checks that the reserves of one reply,
// of different numbers of limits and with an error and a lost epoch among
// them, each decode to their own values (one array serves them in turn),
// and that decoding more of them allocates nothing more.
func TestDecodeReservesEntryByEntry(t *testing.T) {
	day := policy.Rule{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(24 * time.Hour)}}
	hour := policy.Rule{Limit: policy.Limit{Name: "hour", Kind: policy.Fixed, Limit: 10, Window: policy.Duration(time.Hour)}}
	two, one := []policy.Rule{day, hour}, []policy.Rule{day}
	c := Call{Batch: [][]policy.Rule{two, one, one, two}}
	cmd := redis.NewCmd(context.Background())
	cmd.SetVal([]any{
		packed(1, 0, 0, 0, 1000, 3, 4, 30, 60000, 5, 3000),
		packed(1, 0, 0, 0, 1001, 5, 6, 31, 61000),
		packed(-1),
		redis.ErrClosed,
	})
	type got struct {
		now, version int64
		limits       []int64
		err          error
	}
	var gots []got
	DecodeReserves(cmd, &c, func(i int, v ReserveReply, err error) {
		gots = append(gots, got{v.NowMs, v.Version, slices.Clone(v.Limits), err})
	})
	want := []got{{1000, 3, []int64{30, 60000, 5, 3000}, nil}, {1001, 5, []int64{31, 61000}, nil}, {0, 0, nil, ErrNoEpoch}, {0, 0, nil, redis.ErrClosed}}
	if len(gots) != len(want) {
		t.Fatalf("DecodeReserves passed %d entries, want %d", len(gots), len(want))
	}
	for i := range want {
		if g, w := gots[i], want[i]; g.now != w.now || g.version != w.version || !slices.Equal(g.limits, w.limits) || !errors.Is(g.err, w.err) {
			t.Errorf("entry %d = %+v, want %+v", i, g, w)
		}
	}

	decode := func(n int) float64 {
		c := Call{Batch: slices.Repeat([][]policy.Rule{two}, n)}
		cmd := redis.NewCmd(context.Background())
		cmd.SetVal(slices.Repeat([]any{packed(1, 0, 0, 0, 1000, 3, 4, 30, 60000, 5, 3000)}, n))
		return testing.AllocsPerRun(100, func() { DecodeReserves(cmd, &c, func(int, ReserveReply, error) {}) })
	}
	if one, seven := decode(1), decode(7); seven != one {
		t.Errorf("DecodeReserves of 7 reserves: %v allocations, of 1: %v; want as many", seven, one)
	}
}
