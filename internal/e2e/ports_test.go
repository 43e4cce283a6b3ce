package e2e_test

import (
	"net"
	"testing"

	"quotaflow/internal/e2e"
)

// TestFreeAddrsNeverRepeat checks that no address is given twice in a
// process, whether chosen in one call or one at a time and released in
// between (the kernel often hands a just-released port out again), and
// that each can be bound.
func TestFreeAddrsNeverRepeat(t *testing.T) {
	seen := map[string]bool{}
	take := func(addrs []string, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range addrs {
			if seen[a] {
				t.Fatalf("%s given twice", a)
			}
			seen[a] = true
			l, err := net.Listen("tcp", a)
			if err != nil {
				t.Fatalf("%s: %v", a, err)
			}
			l.Close()
		}
	}
	take(e2e.FreeAddrs(50))
	for range 300 {
		a, err := e2e.FreeAddr()
		take([]string{a}, err)
	}
}
