package service

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// ReleaseStartupPages unmaps the executable's read-only pages (its code,
// constants and function tables) from the process, drops the file's pages
// from the page cache, and returns how many bytes were resident in them.
// Run once start-up is done: the pages only start-up used (package
// initialisers, the protobuf and gRPC registries, configuration) then stop
// counting in the resident set, about half of the binary's.
//
// A page used again is read back on its next use, alone: the mappings are
// marked MADV_RANDOM (no read-around), and the cache keeps only what is
// still mapped (a folio, up to 2 MiB, holding a page some thread used
// meanwhile) and what is read since, so the kernel's fault-around, which
// maps the cached pages within 64 KiB of each fault, no longer maps the
// cold neighbours of the hot path's scattered functions and tables (the
// binary's pages resident under load: ~18 → ~8 MB, bench/results.md). The
// cost is a read from disk for each page used again, once, and for each
// page a path not yet taken needs (the first local decisions of an outage).
// Dirty pages (a binary just written) are written back first.
//
// A mapping holding a private copy of any page (Anonymous in smaps: a
// relocation written before it was made read-only), in memory or swapped
// out (Swap, SwapPss), is left alone, since unmapping it would lose the
// write.
func ReleaseStartupPages() (int64, error) {
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return 0, fmt.Errorf("release start-up pages: %w", err)
	}
	maps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return 0, fmt.Errorf("release start-up pages: %w", err)
	}
	// The drop needs the file open: one this process cannot read (mode
	// --x) is only unmapped. A dirty page stays cached unless written back
	// first (a file system that cannot sync keeps those, no more).
	f, dropErr := os.Open(exe)
	if dropErr == nil {
		defer f.Close()
		dropErr = unix.Fdatasync(int(f.Fd()))
	}
	ms := readOnlyMappings(maps, exe)
	var released int64
	for _, m := range ms {
		if err := madvise(m, unix.MADV_RANDOM); err != nil {
			return 0, err
		}
		released += m.rss
	}
	for _, m := range ms {
		if err := madvise(m, unix.MADV_DONTNEED); err != nil {
			return released, err
		}
	}
	if f != nil {
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			dropErr = err
		}
	}
	if dropErr != nil {
		return released, fmt.Errorf("release start-up pages: drop %s from the page cache: %w", exe, dropErr)
	}
	return released, nil
}

func madvise(m mapping, advice int) error {
	if _, _, errno := unix.Syscall(unix.SYS_MADVISE, m.start, m.end-m.start, uintptr(advice)); errno != 0 {
		return fmt.Errorf("release start-up pages: madvise %x-%x: %w", m.start, m.end, errno)
	}
	return nil
}

// mapping is one of /proc/self/smaps: its address range and resident bytes.
type mapping struct {
	start, end uintptr
	rss        int64
}

// readOnlyMappings returns the mappings of file path in smaps that are
// neither writable nor hold a private (anonymous) copy of any page, resident
// or swapped out.
func readOnlyMappings(smaps []byte, path string) []mapping {
	var out []mapping
	var cur mapping
	take, private := false, false
	flush := func() {
		if take && !private {
			out = append(out, cur)
		}
	}
	sc := bufio.NewScanner(bytes.NewReader(smaps))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := bytes.Cut(f[0], []byte("-")); ok && len(f) >= 5 && !bytes.HasSuffix(f[0], []byte(":")) {
			flush() // a mapping's header: start-end perms offset dev inode [path]
			s, err1 := strconv.ParseUint(string(lo), 16, 64)
			e, err2 := strconv.ParseUint(string(hi), 16, 64)
			take = err1 == nil && err2 == nil && len(f) >= 6 && string(bytes.Join(f[5:], []byte(" "))) == path &&
				len(f[1]) == 4 && f[1][0] == 'r' && f[1][1] != 'w'
			cur, private = mapping{start: uintptr(s), end: uintptr(e)}, false
			continue
		}
		switch string(f[0]) {
		case "Rss:":
			kb, _ := strconv.ParseInt(string(f[1]), 10, 64)
			cur.rss = kb << 10
		case "Anonymous:", "Swap:", "SwapPss:":
			private = private || string(f[1]) != "0"
		}
	}
	flush()
	return out
}
