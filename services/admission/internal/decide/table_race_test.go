//go:build race

package decide

import (
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
)

// Under the race detector the table's slots are memory it watches: an
// unlocked write racing another is reported, so the tests check the
// locking. The race is provoked in a child process, which fails.
func TestLocalTableRaceVisible(t *testing.T) {
	if os.Getenv("QF_RACE_PROBE") == "1" {
		d := localDecider(t, Options{})
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() { d.local.buckets[0].st[0].left++ }) // deliberately unlocked
		}
		wg.Wait()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLocalTableRaceVisible$", "-test.count=1")
	cmd.Env = append(os.Environ(), "QF_RACE_PROBE=1")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "DATA RACE") {
		t.Fatalf("an unlocked concurrent write to a slot went unreported (err %v):\n%s", err, out)
	}
}
