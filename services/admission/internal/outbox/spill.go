package outbox

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"quotaflow/pkg/events"
)

// errSpillFull means the spill directory holds MaxSpillBytes already.
var errSpillFull = errors.New("spill directory full")

// segmentExt names spill segments: "<20-digit sequence>.jsonl", so that
// sorting names sorts them by age.
const segmentExt = ".jsonl"

// spillDir is the append-only overflow of an Outbox: a directory of
// segment files, each holding one encoded event per line. Writers append
// to the active segment; the publisher replays closed segments oldest
// first and removes each once every event in it is acknowledged. A file
// lock keeps two processes from sharing the directory.
type spillDir struct {
	dir     string
	lock    *os.File
	max     int64 // bytes on disk at most
	segMax  int64 // rotate the active segment past this size
	total   atomic.Int64
	mu      sync.Mutex
	w       *os.File // active segment, nil when none
	wName   string
	wSize   int64
	closed  []string // closed segments, oldest first
	next    uint64   // sequence of the next segment
	stopped bool
}

// openSpill creates dir if needed, locks it and takes inventory of the
// segments a previous run left.
func openSpill(dir string, maxBytes, segMax int64) (*spillDir, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("spill dir: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o640)
	if err != nil {
		return nil, fmt.Errorf("spill dir: %w", err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("spill dir %s is in use by another process (give each instance its own QF_SPILL_DIR): %w", dir, err)
	}
	s := &spillDir{dir: dir, lock: lock, max: maxBytes, segMax: segMax}
	ents, err := os.ReadDir(dir)
	if err != nil {
		s.close()
		return nil, fmt.Errorf("spill dir: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, segmentExt) {
			continue
		}
		seq, err := strconv.ParseUint(strings.TrimSuffix(name, segmentExt), 10, 64)
		if err != nil {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		if info.Size() == 0 {
			_ = os.Remove(filepath.Join(dir, name))
			continue
		}
		s.closed = append(s.closed, name)
		s.total.Add(info.Size())
		s.next = max(s.next, seq+1)
	}
	slices.Sort(s.closed)
	return s, nil
}

// append writes one line (an encoded event and '\n') to the active
// segment in a single write.
func (s *spillDir) append(line []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return errors.New("spill dir closed")
	}
	if s.total.Load()+int64(len(line)) > s.max {
		return errSpillFull
	}
	if s.w != nil && s.wSize >= s.segMax {
		s.rotateLocked()
	}
	if s.w == nil {
		name := fmt.Sprintf("%020d%s", s.next, segmentExt)
		f, err := os.OpenFile(filepath.Join(s.dir, name), os.O_CREATE|os.O_EXCL|os.O_WRONLY|os.O_APPEND, 0o640)
		if err != nil {
			return fmt.Errorf("spill: %w", err)
		}
		s.next++
		s.w, s.wName, s.wSize = f, name, 0
	}
	n, err := s.w.Write(line)
	s.wSize += int64(n)
	s.total.Add(int64(n))
	if err != nil {
		// A partial line is skipped as corrupt on replay; start afresh.
		s.rotateLocked()
		return fmt.Errorf("spill: %w", err)
	}
	return nil
}

// rotateLocked closes the active segment, making it replayable.
func (s *spillDir) rotateLocked() {
	if s.w == nil {
		return
	}
	_ = s.w.Close()
	s.closed = append(s.closed, s.wName)
	s.w, s.wName, s.wSize = nil, "", 0
}

// oldest returns the oldest segment ready to replay, closing the active
// one when it is all there is. ok is false when nothing is spilled.
func (s *spillDir) oldest() (name string, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.closed) == 0 && s.w != nil && s.wSize > 0 {
		s.rotateLocked()
	}
	if len(s.closed) == 0 {
		return "", false
	}
	return s.closed[0], true
}

// remove deletes a replayed segment.
func (s *spillDir) remove(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	path := filepath.Join(s.dir, name)
	if info, err := os.Stat(path); err == nil {
		s.total.Add(-info.Size())
	}
	s.closed = slices.DeleteFunc(s.closed, func(n string) bool { return n == name })
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("spill: remove replayed segment: %w", err)
	}
	return nil
}

// bytes is how much is spilled and not yet replayed.
func (s *spillDir) bytes() int64 { return s.total.Load() }

// close closes the active segment and releases the lock; the segments
// stay for the next start.
func (s *spillDir) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopped = true
	var err error
	if s.w != nil {
		err = s.w.Close()
		s.w = nil
	}
	if s.lock != nil {
		_ = syscall.Flock(int(s.lock.Fd()), syscall.LOCK_UN)
		_ = s.lock.Close()
		s.lock = nil
	}
	return err
}

// segmentReader reads the events of one spill segment.
type segmentReader struct {
	name string
	f    *os.File
	r    *bufio.Reader
	eof  bool
}

func (s *spillDir) openSegment(name string) (*segmentReader, error) {
	f, err := os.Open(filepath.Join(s.dir, name))
	if err != nil {
		return nil, fmt.Errorf("spill: %w", err)
	}
	return &segmentReader{name: name, f: f, r: bufio.NewReaderSize(f, events.MaxEventSize+2)}, nil
}

// next reads up to n events. Lines that do not decode (a write torn by a
// crash, a damaged disk) are counted in corrupt and skipped.
func (sr *segmentReader) next(n int) (evs []events.Event, corrupt int, err error) {
	for len(evs) < n && !sr.eof {
		line, err := sr.r.ReadSlice('\n')
		switch {
		case errors.Is(err, bufio.ErrBufferFull):
			corrupt++
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = sr.r.ReadSlice('\n')
			}
			if errors.Is(err, io.EOF) {
				sr.eof = true
			} else if err != nil {
				return evs, corrupt, fmt.Errorf("spill: read %s: %w", sr.name, err)
			}
			continue
		case errors.Is(err, io.EOF):
			sr.eof = true
		case err != nil:
			return evs, corrupt, fmt.Errorf("spill: read %s: %w", sr.name, err)
		}
		line = trimNewline(line)
		if len(line) == 0 {
			continue
		}
		ev, derr := events.Decode(line)
		if derr != nil {
			corrupt++
			continue
		}
		evs = append(evs, ev)
	}
	return evs, corrupt, nil
}

func (sr *segmentReader) close() {
	if sr != nil && sr.f != nil {
		_ = sr.f.Close()
		sr.f = nil
	}
}

func trimNewline(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}
