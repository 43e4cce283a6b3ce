package proc

import (
	"os"
	"os/exec"
	"runtime"
	"slices"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// comm may hold spaces and parentheses; the fields count from the last ')'
	line := "4242 (a) b (c)) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 3 4 20 0 1 0 5 1000 10\n"
	s, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if s.comm != "a) b (c)" || s.ppid != 17 || s.cpu != 3250*time.Millisecond || s.reaped != 70*time.Millisecond {
		t.Errorf("parseStat = %+v, want comm %q, ppid 17, cpu 3.25s, reaped 70ms", s, "a) b (c)")
	}
	for _, bad := range []string{"", "1 (x", "1 (x) S 1 2", "1 (x) S z 0 0 0 0 0 0 0 0 0 0 1 1 0 0"} {
		if _, err := parseStat([]byte(bad)); err == nil {
			t.Errorf("parseStat(%q) = nil error, want one", bad)
		}
	}
}

func TestCPUCountsThisProcess(t *testing.T) {
	c0, err := CPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Burn CPU until a tick is counted: the reading must move.
	x := 0
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		for i := range 1_000_000 {
			x += i
		}
		if c, _ := CPU(os.Getpid()); c > c0 {
			return
		}
	}
	t.Fatalf("CPU(self) stayed %v after 30 s of work (%d)", c0, x)
}

func TestTreeAndNamed(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30 & sleep 30 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if pids, err := Tree(cmd.Process.Pid); err == nil {
			for _, p := range pids[1:] {
				if q, err := os.FindProcess(p); err == nil {
					_ = q.Kill()
				}
			}
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	// Until sh has forked both children and each has exec'd sleep (a
	// child is named sh between its fork and its exec), or 30 s: a loaded
	// host may take long, a wrong Tree or Named never gets there.
	var pids, sleeps []int
	named := func() bool {
		for _, p := range pids[1:] {
			if !slices.Contains(sleeps, p) {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var err error
		if pids, err = Tree(cmd.Process.Pid); err != nil {
			t.Fatal(err)
		}
		if sleeps, err = Named("sleep"); err != nil {
			t.Fatal(err)
		}
		if len(pids) == 3 && named() {
			break
		}
	}
	if len(pids) != 3 || pids[0] != cmd.Process.Pid {
		t.Fatalf("Tree(sh) = %v, want sh (%d) and its two sleeps", pids, cmd.Process.Pid)
	}
	if !named() {
		t.Errorf("Named(sleep) = %v, want it to hold %v", sleeps, pids[1:])
	}
	if _, err := TreeCPU(cmd.Process.Pid); err != nil {
		t.Errorf("TreeCPU(sh) = %v", err)
	}
	if _, err := Tree(1 << 30); err == nil {
		t.Error("Tree(no such pid) = nil error, want one")
	}
}

func TestMemory(t *testing.T) {
	m, err := Memory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if m.RSS <= 0 || m.HWM < m.RSS || m.Anon <= 0 || m.File <= 0 || m.Anon+m.File > m.RSS {
		t.Errorf("Memory(self) = %+v, want 0 < RSS ≤ HWM, Anon and File > 0 and within RSS", m)
	}
	if _, err := Memory(1 << 30); err == nil {
		t.Error("Memory(no such pid) = nil error, want one")
	}
}

func TestRunQueueWait(t *testing.T) {
	// One more busy process than CPUs: some must wait for a CPU, and none
	// can have waited longer than it lived, less the CPU time it had (a
	// wrong schedstat field, the time on a CPU, would make the two add up
	// to more than its life on a quiet host).
	n := runtime.NumCPU() + 1
	busy := make([]*exec.Cmd, n)
	start := time.Now()
	for i := range busy {
		busy[i] = exec.Command("sh", "-c", "while :; do :; done")
		if err := busy[i].Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { busy[i].Process.Kill(); busy[i].Wait() })
	}
	time.Sleep(300 * time.Millisecond)
	var total time.Duration
	for _, c := range busy {
		w, err := RunQueueWait(c.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		cpu, err := CPU(c.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		if life := time.Since(start); w+cpu > life+2*tick {
			t.Errorf("RunQueueWait(busy) = %v with %v on a CPU, more than its %v of life", w, cpu, life)
		}
		total += w
	}
	if total <= 0 {
		t.Errorf("RunQueueWait of %d busy processes on %d CPUs = %v in all, want some wait", n, n-1, total)
	}
	if _, err := RunQueueWait(1 << 30); err == nil {
		t.Error("RunQueueWait(no such pid) = nil error, want one")
	}
}
