package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"quotaflow/internal/redistest"
)

// TestScenario runs the demo against the real Redis and checks the story it
// tells: the third request is denied with a Retry-After, the correction and
// the release give tokens back exactly once, the retry is a duplicate.
func TestScenario(t *testing.T) {
	t.Setenv("QF_REDIS_URL", redistest.SharedURL())
	t.Setenv("QF_POLICY_FILE", "../../deploy/policy.yaml")
	var out bytes.Buffer
	if err := run(context.Background(), &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		"admit req-3 (400 tokens): 429 denied by user 5h, Retry-After 4h",
		"correct req-1 to 100 tokens: delta -300, 5h used 500 of 1000",
		"correct req-1 again: already settled, 5h used 500",
		"admit req-3 (400 tokens): 200 allowed (duplicate: nothing charged)",
		"release req-2: delta -400, 5h used 500 of 1000",
		"5h used 0 of 1000; 7d used 500",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out.String())
		}
	}
}
