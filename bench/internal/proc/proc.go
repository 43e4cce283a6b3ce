// Package proc reads what the benchmarks charge to each process from
// Linux's /proc: CPU time (user + system, all threads) of a process, of a
// process tree or of every process of a name (such as Postgres's
// backends), the time its threads waited for a CPU, and resident memory
// (VmRSS, its peak VmHWM, and its anonymous and file-backed parts).
package proc

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// tick is a clock tick of /proc/<pid>/stat: USER_HZ, which Linux fixes at
// 100 for user space on every architecture Go runs on.
const tick = 10 * time.Millisecond

// stat is what the benchmarks use of /proc/<pid>/stat.
type stat struct {
	comm        string
	ppid        int
	cpu, reaped time.Duration // its own threads; its waited-for children
}

func readStat(pid int) (stat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, err
	}
	return parseStat(b)
}

// parseStat reads a stat line: "pid (comm) state ppid …", comm possibly
// holding spaces and parentheses, so the fields after it are counted from
// its last ')'.
func parseStat(b []byte) (stat, error) {
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open || end+2 > len(b) {
		return stat{}, fmt.Errorf("proc: bad stat line %q", b)
	}
	f := strings.Fields(string(b[end+2:])) // f[0] is field 3, state
	if len(f) < 15 {
		return stat{}, fmt.Errorf("proc: short stat line %q", b)
	}
	var n [5]int64 // ppid, utime, stime, cutime, cstime: fields 4, 14–17
	for i, j := range []int{1, 11, 12, 13, 14} {
		v, err := strconv.ParseInt(f[j], 10, 64)
		if err != nil {
			return stat{}, fmt.Errorf("proc: stat field %d: %w", j+3, err)
		}
		n[i] = v
	}
	return stat{
		comm: string(b[open+1 : end]), ppid: int(n[0]),
		cpu: time.Duration(n[1]+n[2]) * tick, reaped: time.Duration(n[3]+n[4]) * tick,
	}, nil
}

// CPU is the CPU time process pid has used so far, user and system, over
// all its threads (in 10 ms ticks).
func CPU(pid int) (time.Duration, error) {
	s, err := readStat(pid)
	return s.cpu, err
}

// TreeCPU is the CPU time of pid and its descendants: of those alive, and
// of those that exited and were waited for (their parents' reaped time),
// so a child that exits between two readings is still counted once.
func TreeCPU(pid int) (time.Duration, error) {
	all, err := scan()
	if err != nil {
		return 0, err
	}
	if _, ok := all[pid]; !ok {
		return 0, fmt.Errorf("proc: no process %d", pid)
	}
	var sum time.Duration
	for _, p := range tree(all, pid) {
		sum += all[p].cpu + all[p].reaped
	}
	return sum, nil
}

// Tree lists pid and its living descendants.
func Tree(pid int) ([]int, error) {
	all, err := scan()
	if err != nil {
		return nil, err
	}
	if _, ok := all[pid]; !ok {
		return nil, fmt.Errorf("proc: no process %d", pid)
	}
	return tree(all, pid), nil
}

func tree(all map[int]stat, root int) []int {
	out := []int{root}
	for i := 0; i < len(out); i++ { // breadth first; out grows as it goes
		for p, s := range all {
			if s.ppid == out[i] && p != out[i] {
				out = append(out, p)
			}
		}
	}
	return out
}

// Named lists the processes whose name (comm, at most 15 bytes) is name.
func Named(name string) ([]int, error) {
	all, err := scan()
	if err != nil {
		return nil, err
	}
	var out []int
	for p, s := range all {
		if s.comm == name {
			out = append(out, p)
		}
	}
	return out, nil
}

// scan reads every process's stat; processes that exit while it reads are
// left out.
func scan() (map[int]stat, error) {
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return nil, err
	}
	all := make(map[int]stat, len(dirs))
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		if s, err := readStat(pid); err == nil {
			all[pid] = s
		}
	}
	return all, nil
}

// Mem is a process's resident memory in bytes: now (VmRSS) and at its peak
// (VmHWM), and what VmRSS holds of anonymous memory (RssAnon: the heap,
// stacks, mappings of its own) and of files' pages (RssFile: the binary's
// text and read-only data, shared libraries), which the kernel can drop
// and read again.
type Mem struct{ RSS, HWM, Anon, File int64 }

// Memory reads process pid's resident memory.
func Memory(pid int) (Mem, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Mem{}, err
	}
	var m Mem
	fields := map[string]*int64{"VmRSS": &m.RSS, "VmHWM": &m.HWM, "RssAnon": &m.Anon, "RssFile": &m.File}
	var found int
	for _, line := range strings.Split(string(b), "\n") {
		name, v, ok := strings.Cut(line, ":")
		dst := fields[name]
		if !ok || dst == nil {
			continue
		}
		f := strings.Fields(v)
		if len(f) != 2 || f[1] != "kB" {
			return Mem{}, fmt.Errorf("proc: %d: bad %s line %q", pid, name, line)
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return Mem{}, fmt.Errorf("proc: %d: bad %s line %q", pid, name, line)
		}
		*dst = kb << 10
		found++
	}
	if found != len(fields) {
		return Mem{}, fmt.Errorf("proc: %d: no VmRSS, VmHWM, RssAnon and RssFile (a kernel thread or a zombie)", pid)
	}
	return m, nil
}

// RunQueueWait is the time the threads of process pid now alive have
// spent runnable but waiting for a CPU (the second field of each
// /proc/<pid>/task/<tid>/schedstat, in ns): on a host with more runnable
// threads than cores, the latency the kernel adds to whatever the process
// was about to do.
func RunQueueWait(pid int) (time.Duration, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/[0-9]*/schedstat", pid))
	if err != nil {
		return 0, err
	}
	if len(tasks) == 0 {
		return 0, fmt.Errorf("proc: no process %d, or no schedstat (CONFIG_SCHEDSTATS)", pid)
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread exited
		}
		f := strings.Fields(string(b))
		if len(f) < 2 {
			return 0, fmt.Errorf("proc: bad %s %q", t, b)
		}
		ns, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("proc: bad %s %q", t, b)
		}
		sum += time.Duration(ns)
	}
	return sum, nil
}
