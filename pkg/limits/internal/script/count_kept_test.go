package script

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
)

// count.lua keeps its scratch tables from call to call (lib.lua's cwin...,
// reset by marks), where the same code run as a script (the EVAL path of a
// Redis without functions) starts with new ones each call. Random calls
// run both ways, on two databases of one server, must answer, store and
// expire alike: a value an earlier call left (more keys, other groups, a
// call that failed midway) that a later call read would show here.
func TestCountKeptTablesDecideAsNewOnes(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	fn := redis.NewClient(&redis.Options{Addr: srv.Addr, DB: 0})
	ev := redis.NewClient(&redis.Options{Addr: srv.Addr, DB: 1})
	t.Cleanup(func() { fn.Close(); ev.Close() })
	if err := fn.FunctionLoad(ctx, engine.code).Err(); err != nil {
		t.Fatal(err)
	}
	both := func(f func(c *redis.Client)) { f(fn); f(ev) }

	// Two epoch keys and eight counters, each counter with a window of its
	// own (every window a whole number of hours: see nearTurn).
	pool := []string{"e0", "e1", "c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"}
	window := map[string]int64{"c0": 3_600_000, "c1": 3_600_000, "c2": 86_400_000, "c3": 7_200_000,
		"c4": 3_600_000, "c5": 86_400_000, "c6": 3_600_000, "c7": 7_200_000}
	both(func(c *redis.Client) { c.Set(ctx, "e0", "1", 0); c.Set(ctx, "e1", "1", 0) })

	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	for it := range 1500 {
		switch rng.IntN(40) { // the same change on both sides
		case 0:
			e := pool[rng.IntN(2)]
			both(func(c *redis.Client) { c.Del(ctx, e) })
		case 1:
			e := pool[rng.IntN(2)]
			both(func(c *redis.Client) { c.Set(ctx, e, "1", 0) })
		case 2:
			k := pool[2+rng.IntN(8)]
			both(func(c *redis.Client) { c.Set(ctx, k, "bad", 0) }) // too short: the call fails midway
		case 3, 4:
			k := pool[2+rng.IntN(8)]
			both(func(c *redis.Client) { c.Del(ctx, k) })
		}
		keys, args := randomCount(rng, pool, window)
		nearTurn()
		r1, e1 := fn.Do(ctx, append(append([]any{"FCALL", Count.fn, len(keys)}, anys(keys)...), args...)...).Result()
		r2, e2 := Count.script().Eval(ctx, ev, keys, args...).Result()
		if (e1 == nil) != (e2 == nil) {
			t.Fatalf("call %d: FCALL's error %v, EVAL's %v", it, e1, e2)
		}
		if e1 == nil && !reflect.DeepEqual(r1.([]any)[1:], r2.([]any)[1:]) { // [0] is Redis's time
			t.Fatalf("call %d (keys %v): FCALL answered %v, EVAL %v", it, keys, r1.([]any)[1:], r2.([]any)[1:])
		}
		s1, s2 := stored(t, fn, pool), stored(t, ev, pool)
		for i, k := range pool {
			if s1[i].val != s2[i].val {
				t.Fatalf("call %d: %s holds %q after FCALL, %q after EVAL", it, k, s1[i].val, s2[i].val)
			}
			if d := s1[i].ttl - s2[i].ttl; d > 200*time.Millisecond || d < -200*time.Millisecond {
				t.Fatalf("call %d: %s expires in %v after FCALL, %v after EVAL", it, k, s1[i].ttl, s2[i].ttl)
			}
		}
	}
}

// randomCount returns a count call's keys and arguments (count.lua's KEYS
// and ARGV): some of pool in random order, then up to six groups, each a
// decision or an adjustment (now, or dated now) of up to four counters,
// repeats, shadows, a negative cost in adjustments and a counter cut short
// among them.
func randomCount(rng *rand.Rand, pool []string, window map[string]int64) ([]string, []any) {
	perm := rng.Perm(len(pool))
	keys := make([]string, 1+rng.IntN(len(pool)))
	var epochs, counters []int // KEYS indexes, from 1
	for i := range keys {
		keys[i] = pool[perm[i]]
		if keys[i][0] == 'e' {
			epochs = append(epochs, i+1)
		} else {
			counters = append(counters, i+1)
		}
	}
	head := make([]byte, 7) // clock offset 0, then the guard flag
	head[6] = byte(rng.IntN(2))
	args := []any{string(head)}
	for range rng.IntN(7) {
		if len(counters) == 0 {
			break
		}
		n := rng.IntN(5)
		g := make([]byte, 6+23*n) // '<i6', then '<I2I2i6i6i6B' a counter
		at := int64(0)            // a decision
		if rng.IntN(3) == 0 {
			at = -1 // an adjustment now
			if rng.IntN(3) == 0 {
				at = time.Now().UnixMilli()
			}
		}
		put48(g, at)
		for i := range n {
			c := g[6+23*i:]
			e := 1 + rng.IntN(len(keys))
			if len(epochs) > 0 && rng.IntN(4) != 0 {
				e = epochs[rng.IntN(len(epochs))]
			}
			k := counters[rng.IntN(len(counters))]
			cost := int64(rng.IntN(4))
			if at != 0 && rng.IntN(2) == 0 {
				cost = -cost
			}
			binary.LittleEndian.PutUint16(c, uint16(e))
			binary.LittleEndian.PutUint16(c[2:], uint16(k))
			put48(c[4:], cost)
			put48(c[10:], int64(rng.IntN(12)))
			put48(c[16:], window[keys[k-1]])
			if rng.IntN(5) == 0 {
				c[22] = 1 // shadow
			}
		}
		if n > 0 && rng.IntN(60) == 0 {
			g = g[:len(g)-3] // malformed: the call fails midway
		}
		args = append(args, string(g))
	}
	return keys, args
}

// nearTurn waits out the last 50 ms before a whole hour, so that the two
// sides of a call see every window in the same number (both take Redis's
// TIME, a few hundred µs apart).
func nearTurn() {
	const hour = int64(time.Hour / time.Millisecond)
	if left := hour - time.Now().UnixMilli()%hour; left < 50 {
		time.Sleep(time.Duration(left+10) * time.Millisecond)
	}
}

type value struct {
	val string
	ttl time.Duration
}

// stored reads every key of pool and its ttl in one round trip.
func stored(t *testing.T, c *redis.Client, pool []string) []value {
	t.Helper()
	ctx := context.Background()
	gets := make([]*redis.StringCmd, len(pool))
	ttls := make([]*redis.DurationCmd, len(pool))
	if _, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range pool {
			gets[i], ttls[i] = p.Get(ctx, k), p.PTTL(ctx, k)
		}
		return nil
	}); err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	out := make([]value, len(pool))
	for i := range pool {
		out[i] = value{gets[i].Val(), ttls[i].Val()}
	}
	return out
}

func put48(b []byte, v int64) {
	var x [8]byte
	binary.LittleEndian.PutUint64(x[:], uint64(v))
	copy(b, x[:6])
}

func anys(s []string) []any {
	out := make([]any, len(s))
	for i := range s {
		out[i] = s[i]
	}
	return out
}
