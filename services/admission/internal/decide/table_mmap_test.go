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
