package heapfloor

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"
)

func TestPercent(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name              string
		floor             uint64
		base              int
		live, roots, want uint64
	}{
		// goal = live + (live+roots)×GOGC/100, at least 4 MiB×GOGC/100
		{"small heap: the floor's minimum goal", 16 * mib, 100, 1 * mib, 0, 400},
		{"the goal reaches the floor", 16 * mib, 100, 6 * mib, 2 * mib, 125},
		{"at half the floor GOGC=100 gives it", 16 * mib, 100, 8 * mib, 0, 100},
		{"live over half the floor: base", 16 * mib, 100, 12 * mib, 0, 100},
		{"live over the floor: base", 16 * mib, 100, 40 * mib, mib, 100},
		{"a higher base stays", 16 * mib, 300, 6 * mib, 0, 300},
		{"a floor under the minimum goal: base", 2 * mib, 100, mib, 0, 100},
		{"nothing live", 16 * mib, 100, 0, 0, 400},
		{"a floor past 1 TiB is 1 TiB", math.MaxUint64, 100, mib, 0, (1 << 40) * 100 / (4 * mib)},
	} {
		if got := percent(tc.floor, tc.base, tc.live, tc.roots); got != int(tc.want) {
			t.Errorf("%s: percent(%d MiB, %d, %d, %d) = %d, want %d", tc.name, tc.floor/mib, tc.base, tc.live, tc.roots, got, tc.want)
		}
	}
}

// TestKeep runs the collector with Keep in force: a small live heap gets a
// goal of at least the floor (Go's own is ~4 MiB), a live heap past the
// floor the goal GOGC=100 gives it (about twice what is live).
func TestKeep(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	const floor = 48 << 20
	k := keep(floor)
	defer k.stopped.Store(true)

	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}, {Name: "/gc/heap/live:bytes"}, {Name: "/gc/gogc:percent"}}
	// settle collects until the finalizer has set GOGC for what is live now
	// and a collection has applied it, then reports the goal and the live heap.
	settle := func(want func(gogc uint64) bool) (goal, live uint64) {
		for deadline := time.Now().Add(30 * time.Second); ; {
			runtime.GC()
			time.Sleep(10 * time.Millisecond) // the finalizer goroutine runs
			metrics.Read(s)
			if want(s[2].Value.Uint64()) {
				return s[0].Value.Uint64(), s[1].Value.Uint64()
			}
			if time.Now().After(deadline) {
				t.Fatalf("GOGC stayed %d (goal %d, live %d)", s[2].Value.Uint64(), s[0].Value.Uint64(), s[1].Value.Uint64())
			}
		}
	}

	goal, live := settle(func(gogc uint64) bool { return gogc > 100 })
	// the goal is the floor as of the collection before (live moves a little)
	if goal < floor || goal > floor+floor/10 {
		t.Errorf("small heap (%d bytes live): goal %d, want the floor %d", live, goal, uint64(floor))
	}

	big := make([][]byte, 64) // 64 MiB live, past the floor
	for i := range big {
		big[i] = make([]byte, 1<<20)
	}
	goal, live = settle(func(gogc uint64) bool { return gogc == 100 })
	if goal > live*21/10+(8<<20) {
		t.Errorf("heap past the floor (%d bytes live): goal %d, want about twice what is live", live, goal)
	}
	runtime.KeepAlive(big)
	big = nil

	// memory outside the heap takes its share of the floor: with all of it
	// counted, the heap's goal is GOGC's again
	Count(func() uint64 { return floor })
	defer Count(func() uint64 { return 0 })
	if goal, live = settle(func(gogc uint64) bool { return gogc == 100 }); goal >= floor {
		t.Errorf("the floor all counted outside the heap (%d bytes live): goal %d, want GOGC's, under the floor %d", live, goal, uint64(floor))
	}
}

func TestKeepLeavesGCOff(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	if k := keep(48 << 20); k != nil {
		k.stopped.Store(true)
		t.Error("GOGC=off: Keep tunes GOGC")
	}
}
