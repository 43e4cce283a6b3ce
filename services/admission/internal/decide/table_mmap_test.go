//go:build linux && !race

package decide

import (
	"log/slog"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// A table's mapping is released once the table is unreachable (every
// Decider a test creates maps megabytes).
func TestLocalTableUnmapped(t *testing.T) {
	tb := newLocalTable(1000, slog.New(slog.DiscardHandler))
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(tb.buckets)))
	size := uintptr(len(tb.buckets)) * unsafe.Sizeof(bucket{})
	mapped := func() bool { // msync fails with ENOMEM on memory not mapped
		_, _, errno := syscall.Syscall(syscall.SYS_MSYNC, addr, size, syscall.MS_ASYNC)
		return errno != syscall.ENOMEM
	}
	if !mapped() {
		t.Fatal("a new table's buckets are not mapped memory")
	}
	tb = nil
	for i := 0; mapped(); i++ {
		if i == 1000 {
			t.Fatal("the mapping outlived its table")
		}
		runtime.GC()
		time.Sleep(time.Millisecond) // the cleanup runs on its own goroutine
	}
}

// resident counts the table's pages in memory: none of a new table, the
// used ones once used (what heapfloor counts against admission's floor).
func TestLocalTableResident(t *testing.T) {
	tb := newLocalTable(100_000, slog.New(slog.DiscardHandler))
	if r := tb.resident(); r != 0 {
		t.Fatalf("a new table: %d bytes resident, want 0", r)
	}
	half := len(tb.buckets) / 2
	for i := range tb.buckets[:half] {
		tb.buckets[i].owner[0] = 1
	}
	used := uint64(half) * uint64(unsafe.Sizeof(bucket{}))
	// pages hold parts of two buckets, and the kernel may map huge pages
	if r := tb.resident(); r < used || r > used+4<<20 {
		t.Errorf("half the buckets used (%d bytes): %d bytes resident", used, r)
	}
	runtime.KeepAlive(tb)
}
