//go:build !linux || race

package decide

import "log/slog"

// alloc puts t's n buckets on the heap, where the collector does not scan them
// (they hold no pointer). table_mmap.go keeps them off the heap on Linux
// outside race builds.
func (t *localTable) alloc(n int, _ *slog.Logger) { t.onHeap(n) }

// resident is 0: the runtime counts buckets on the heap.
func (t *localTable) resident() uint64 { return 0 }
