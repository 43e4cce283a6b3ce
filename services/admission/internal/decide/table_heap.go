//go:build !linux || race

package decide

import "log/slog"

// alloc puts t's n buckets on the heap, where the collector does not scan them
// (they hold no pointer). table_mmap.go keeps them off the heap on Linux
// outside race builds.
func (t *localTable) alloc(n int, _ *slog.Logger) { t.onHeap(n) }
