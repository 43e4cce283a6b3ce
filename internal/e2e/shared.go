package e2e

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"
)

// What the tests of every package share, and the demo, the chaos suite and
// the benchmark with them: they run beside other runs on shared servers
// and watch work done on other goroutines and processes.

// FreePort returns a loopback port nothing listens on right now.
func FreePort() (int, error) {
	ps, err := FreePorts(1)
	if err != nil {
		return 0, err
	}
	return ps[0], nil
}

// FreePorts returns n distinct loopback ports nothing listens on right
// now: each is held until all are chosen, so no two are the same, and none
// is one this process was given before, which its owner may not have bound
// yet (an address chosen before a stack's is not chosen again for it).
func FreePorts(n int) ([]int, error) {
	given.Lock()
	defer given.Unlock()
	ps := make([]int, 0, n)
	for len(ps) < n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		if p := l.Addr().(*net.TCPAddr).Port; !given.ports[p] {
			given.ports[p] = true
			ps = append(ps, p)
		}
	}
	return ps, nil
}

// given holds the ports FreePorts returned: a process uses few.
var given = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// FreeAddrs is FreePorts as host:port, for what a test or a service
// listens on: all the addresses a stack needs, chosen at once.
func FreeAddrs(n int) ([]string, error) {
	ps, err := FreePorts(n)
	if err != nil {
		return nil, err
	}
	addrs := make([]string, n)
	for i, p := range ps {
		addrs[i] = "127.0.0.1:" + strconv.Itoa(p)
	}
	return addrs, nil
}

// FreeAddr is one of FreeAddrs.
func FreeAddr() (string, error) {
	addrs, err := FreeAddrs(1)
	if err != nil {
		return "", err
	}
	return addrs[0], nil
}

// RandomHex returns n random bytes in hex: the suffix that makes a run's
// tenants, tokens, streams and databases its own on shared servers.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Buffer collects output that several goroutines write (a logger, a
// receiver's handlers), for a test to read while they still may.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Readyz returns the status code and body of /readyz on the ops address
// addr (host:port), or 0 and "" when nothing answers there.
func Readyz(addr string) (int, string) {
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// patience bounds Eventually: far above what a healthy wait takes, so a
// slow shared machine does not fail a test.
const patience = 30 * time.Second

// Eventually polls cond until it holds, failing the test when it does not
// within patience: a test waits for what happens on other goroutines
// instead of sleeping through a guess.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	EventuallyLast(t, what, func() (bool, string) { return cond(), "" })
}

// EventuallyLast is Eventually for a cond that also describes the state it
// saw (a row's status, a count): the failure reports the last one, which
// says how far the wait got.
func EventuallyLast(t testing.TB, what string, cond func() (ok bool, last string)) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for {
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if last != "" {
				t.Fatalf("timed out after %v waiting for %s (last: %s)", patience, what, last)
			}
			t.Fatalf("timed out after %v waiting for %s", patience, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
