package main

import (
	"encoding/json"
	"fmt"
	"testing"
)

// An endpoint with a per-user token limit keeps the plan's fixed window of
// requests in the blob for every endpoint (policy.Resolved.Counted), so the
// window admits its limit once, not once per store.
const splitPolicy = `
default_plan: rpm
plans:
  rpm:
    rates: [{name: hour, kind: fixed, window: 1h, limit: 3}]
endpoints:
  /chat:
    user: [{name: tok, kind: rolling, unit: tokens, window: 1h, limit: 1000000}]
`

func TestCountedWindowOverTwoEndpoints(t *testing.T) {
	s := newStack(t, splitPolicy, nil)
	n := 0
	for i := range 6 {
		for _, ep := range []string{"/chat", "/embed"} {
			b, _ := json.Marshal(map[string]any{"tenant": s.tenant, "user": "u", "request_id": fmt.Sprint(ep, i), "endpoint": ep, "estimated_tokens": 1})
			if a := s.call("POST", "/v1/admit", string(b)); a.code == 200 {
				n++
			}
		}
	}
	if n != 3 {
		t.Fatalf("a plan's hour of 3 admitted %d over two endpoints", n)
	}
}
