package service

import (
	"errors"
	"os"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestReleaseStartupPages: most of the executable's read-only pages resident
// before the call are unmapped by it (the test binary goes on running,
// mapping back what it uses), and most of its pages cached before it are
// no longer in the page cache after it (which keeps the kernel's
// fault-around from mapping them back beside the pages used). The pages are
// first all mapped in (and so cached): a run after another in the same
// process (-count 2) would otherwise start from what the first left, the few
// pages used since, and compare those with themselves.
func TestReleaseStartupPages(t *testing.T) {
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		t.Skip("no /proc/self/exe:", err)
	}
	mappings := func() []mapping {
		maps, err := os.ReadFile("/proc/self/smaps")
		if err != nil {
			t.Fatal(err)
		}
		return readOnlyMappings(maps, exe)
	}
	resident := func() (n int64) {
		for _, m := range mappings() {
			n += m.rss
		}
		return n
	}
	for _, m := range mappings() {
		if err := madvise(m, unix.MADV_POPULATE_READ); errors.Is(err, unix.EINVAL) {
			t.Skip("no MADV_POPULATE_READ (Linux 5.14):", err)
		} else if err != nil {
			t.Fatal(err)
		}
	}
	before, cachedBefore := resident(), cached(t, exe)
	released, err := ReleaseStartupPages()
	after, cachedAfter := resident(), cached(t, exe)
	if err != nil {
		t.Fatalf("ReleaseStartupPages() = %v", err)
	}
	t.Logf("read-only pages resident: %d KiB before, %d KiB after; released %d KiB; cached: %d KiB before, %d KiB after",
		before>>10, after>>10, released>>10, cachedBefore>>10, cachedAfter>>10)
	if released < before/2 || after >= before/2 {
		t.Errorf("ReleaseStartupPages() released %d of %d resident bytes, %d resident after; want most of them released", released, before, after)
	}
	if cachedAfter >= cachedBefore/2 {
		t.Errorf("ReleaseStartupPages() left %d of %d cached bytes of %s in the page cache; want most of them dropped", cachedAfter, cachedBefore, exe)
	}
}

// cached returns the bytes of file path in the page cache (mincore over a
// mapping of it, which does not fault pages in).
func cached(t *testing.T, path string) int64 {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	page := os.Getpagesize()
	vec := make([]byte, (len(mem)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)), uintptr(unsafe.Pointer(unsafe.SliceData(vec)))); errno != 0 {
		t.Fatal("mincore:", errno)
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return n * int64(page)
}

// TestReadOnlyMappings: only the named file's mappings that are neither
// writable nor hold a private copy of a page, resident or swapped out, are
// released; unmapping one of the others would lose what was written to it.
func TestReadOnlyMappings(t *testing.T) {
	smaps := []byte(`00400000-01186000 r-xp 00000000 08:01 123 /srv/admission bin
Size:              14104 kB
Rss:                9496 kB
Anonymous:             0 kB
Swap:                  0 kB
SwapPss:               0 kB
VmFlags: rd ex mr mw me dw
01186000-0269b000 r--p 00d86000 08:01 123 /srv/admission bin
Rss:               11348 kB
Anonymous:             0 kB
0269b000-02728000 rw-p 0229b000 08:01 123 /srv/admission bin
Rss:                 436 kB
Anonymous:           120 kB
02728000-02730000 r--p 0232b000 08:01 123 /srv/admission bin
Rss:                   8 kB
Anonymous:             8 kB
02730000-047b1000 rw-p 00000000 00:00 0 
Rss:                 388 kB
Anonymous:           388 kB
047b1000-0483f000 r--p 0232c000 08:01 123 /srv/admission bin
Rss:                 116 kB
Anonymous:             0 kB
Swap:                824 kB
Locked:                0 kB
0483f000-04840000 r--p 023ba000 08:01 123 /srv/admission bin
Rss:                   0 kB
Anonymous:             0 kB
Swap:                  0 kB
SwapPss:               4 kB
7f3ad410c000-7f3ad4262000 r-xp 00028000 08:01 77 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 912 kB
Anonymous:             0 kB
7f3ad4262000-7f3ad4263000 r--p 00000000 08:01 124 /srv/admission bin2
Rss:                   4 kB
Anonymous:             0 kB
`)
	got := readOnlyMappings(smaps, "/srv/admission bin")
	want := []mapping{{0x400000, 0x1186000, 9496 << 10}, {0x1186000, 0x269b000, 11348 << 10}}
	if !slices.Equal(got, want) {
		t.Errorf("readOnlyMappings() = %x, want %x", got, want)
	}
}
