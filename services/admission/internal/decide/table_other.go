//go:build !linux

package decide

// newSlots allocates n slots on the heap, where the collector does not scan
// them (a slot holds no pointer). table_linux.go keeps them off the heap.
func newSlots(n int) []slot { return make([]slot, n) }
