//go:build linux && !race

package decide

import (
	"log/slog"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

// alloc maps t's n buckets in anonymous memory outside the Go heap: the
// collector neither scans them (they hold no pointer) nor counts them in its
// heap goal, which would let the heap grow by their size again before
// collecting (GOGC=100), and the kernel makes a page resident only once it
// is used. The mapping is released once t is unreachable, not on Close:
// Admit keeps deciding locally after Close. A refused mapping is logged, and
// the table then lives on the heap.
//
// Race builds use table_heap.go: the race detector does not watch mapped
// memory, and the tests must see the table's races.
func (t *localTable) alloc(n int, log *slog.Logger) {
	size := n * int(unsafe.Sizeof(bucket{}))
	mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		log.Warn("local state kept on the heap: mmap refused", "bytes", size, "err", err)
		t.onHeap(n)
		return
	}
	t.buckets = unsafe.Slice((*bucket)(unsafe.Pointer(unsafe.SliceData(mem))), n)
	t.mapped = mem
	runtime.AddCleanup(t, func(mem []byte) { _ = syscall.Munmap(mem) }, mem)
}

// resident is how many bytes of t's mapping the kernel holds in memory
// (mincore), 0 for buckets on the heap, whose bytes the runtime counts.
// Its pages become resident as owners are remembered, in no order, and
// stay: all of them once about a tenth of its entries have been used.
func (t *localTable) resident() uint64 {
	if len(t.mapped) == 0 {
		return 0
	}
	page := os.Getpagesize()
	vec := make([]byte, (len(t.mapped)+page-1)/page)
	_, _, errno := syscall.Syscall(syscall.SYS_MINCORE, uintptr(unsafe.Pointer(unsafe.SliceData(t.mapped))),
		uintptr(len(t.mapped)), uintptr(unsafe.Pointer(unsafe.SliceData(vec))))
	if errno != 0 {
		return uint64(len(t.mapped)) // as if all resident: the floor errs low
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return uint64(n * page)
}
