// Package heapfloor lets a process's heap grow to a floor before the
// collector runs, and leaves the collector as GOGC sets it above that.
//
// Go collects when the heap reaches its goal: what was live after the last
// collection plus GOGC per cent of it (and of the stacks and globals), and
// at least 4 MB × GOGC/100. A service whose live heap is a few MB therefore
// collects every few MB it allocates: admission answering gRPC calls keeps
// ~2 MB live and allocates ~7 kB a call, so it collected every ~600 calls,
// and the collector, with the stacks it shrinks and the service regrows,
// held a tenth or more of its CPU per call (bench/results.md, issue 14).
// Raising GOGC raises every goal, the large ones too: GOGC=400 put ~25 MiB
// on the five-limit admit's resident memory. A floor raises only the small
// goals: after each collection Keep sets GOGC so that the next goal is the
// floor, or what the configured GOGC gives when that is more. Each goal is
// then the larger of the two as of the collection before it (a heap that
// grows fast past the floor keeps the higher GOGC for one more cycle), and
// the collector never runs more often than GOGC alone would make it.
//
// Memory the process holds outside the heap on purpose (admission's local
// table, mapped and ~11 MiB resident once full) is counted against the
// floor (Count): the floor bounds the two together, so a service whose
// table is full collects as GOGC says, and the floor spends on the heap
// only the memory the table does not use.
package heapfloor

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
)

// maxFloor is the largest floor kept (1 TiB), so that no product of a
// floor overflows and every GOGC fits the runtime's int32.
const maxFloor = 1 << 40

// minHeap is the runtime's least heap goal at GOGC=100; it scales with GOGC.
const minHeap = 4 << 20

// names are the runtime metrics a goal is made of, read after each
// collection: the live heap, then the stacks and globals it scans.
var names = [...]string{"/gc/heap/live:bytes", "/gc/scan/stack:bytes", "/gc/scan/globals:bytes"}

// outside reports the bytes Count counts; nil: none.
var outside atomic.Pointer[func() uint64]

// Count counts the bytes f reports, memory held outside the Go heap,
// against the floor from the next collection on: the heap's floor is the
// floor less f(). f is called once after each collection, on the
// finalizer goroutine. A later Count replaces an earlier one.
func Count(f func() uint64) { outside.Store(&f) }

// Keep holds the heap goal at floor bytes or more from the next collection
// on, for as long as the process runs, and returns at once. Above the floor
// the goal is what the GOGC in force when Keep is called gives. With
// GOGC=off (or 0), or a floor of 0, it does nothing. Call it once.
func Keep(floor uint64) { keep(floor) }

// keep is Keep, returning its keeper (nil when it keeps nothing) for tests
// to stop.
func keep(floor uint64) *keeper {
	if floor == 0 {
		return nil
	}
	gogc := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(gogc)
	base := int(int64(gogc[0].Value.Uint64())) // off: -1, sign-extended
	if base <= 0 {
		return nil
	}
	k := &keeper{floor: floor, base: base}
	for i, n := range names {
		k.samples[i].Name = n
	}
	k.arm()
	return k
}

type keeper struct {
	floor   uint64
	base    int
	samples [len(names)]metrics.Sample
	stopped atomic.Bool // no more tuning: set by tests only
}

// sentinel is garbage whose finalizer runs after the collection that finds
// it; it is larger than the allocations the runtime packs together (16
// bytes), whose finalizers may never run.
type sentinel struct{ _ [32]byte }

// arm leaves a sentinel whose finalizer tunes GOGC and arms the next: one
// call after every collection, on the finalizer goroutine.
func (k *keeper) arm() {
	runtime.SetFinalizer(&sentinel{}, func(*sentinel) {
		if k.stopped.Load() {
			return
		}
		metrics.Read(k.samples[:])
		live := k.samples[0].Value.Uint64()
		roots := k.samples[1].Value.Uint64() + k.samples[2].Value.Uint64()
		floor := k.floor
		if f := outside.Load(); f != nil {
			floor -= min(floor, (*f)())
		}
		debug.SetGCPercent(percent(floor, k.base, live, roots))
		k.arm()
	})
}

// percent is the GOGC whose goal is floor after a collection that left live
// bytes of heap and roots bytes of stacks and globals, or base when base
// gives more. The goal is live + (live+roots)×GOGC/100, and at least
// minHeap×GOGC/100, which alone would put it over floor past
// floor×100/minHeap.
func percent(floor uint64, base int, live, roots uint64) int {
	floor = min(floor, maxFloor)
	if live >= floor {
		return base
	}
	want := min((floor-live)*100/max(live+roots, 1), floor*100/minHeap)
	return max(base, int(want))
}
