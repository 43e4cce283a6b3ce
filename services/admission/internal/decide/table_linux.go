package decide

import (
	"syscall"
	"unsafe"
)

// newSlots maps n slots of anonymous memory outside the Go heap: the
// collector neither scans them (a slot holds no pointer) nor counts them
// in its heap goal, which would let the heap grow by their size again
// before collecting (GOGC=100), and the kernel makes a page resident only
// once a slot on it is used. It falls back to the heap if the mapping is
// refused. The table lives as long as the process: it is never unmapped.
func newSlots(n int) []slot {
	size := n * int(unsafe.Sizeof(slot{}))
	mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return make([]slot, n)
	}
	return unsafe.Slice((*slot)(unsafe.Pointer(unsafe.SliceData(mem))), n)
}
