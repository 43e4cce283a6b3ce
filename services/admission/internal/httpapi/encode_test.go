package httpapi

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"
)

func decisionCases() map[string]decisionBody {
	lim := limitJSON{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: 10, Remaining: 990, ResetSeconds: 18000}
	return map[string]decisionBody{
		"allowed":    {Allowed: true, RequestID: "r-1", Limits: []limitJSON{lim, {Scope: "user", Name: "rps", Endpoint: "/v1/chat", Unit: "requests", Limit: -1, Shadow: true}}},
		"no limits":  {Allowed: true, RequestID: "r-2", Limits: []limitJSON{}},
		"nil limits": {RequestID: "r-3"},
		"zero":       {},
		"denied": {
			Type: ProblemQuotaExceeded, Title: "Request cannot be satisfied", Status: 429, Detail: `user limit "5h": needs 5 tokens`,
			ViolatedPolicies: []string{"user:5h", "x"}, RequestID: "r-4", DeniedBy: &limitRef{Scope: "user", Name: "5h", Endpoint: "/e"},
			Reason: "cost_exceeds_limit", RetryAfterSeconds: 3600, Limits: []limitJSON{lim},
		},
		"odd strings": {
			RequestID: "<a&b>\u2028\u2029\x00\x1f\x7f\"\\é€😀\xff\xfe", DeniedBy: &limitRef{Scope: "\t", Name: "\n"},
			Limits: []limitJSON{{Scope: "\u00e9", Name: "a\"b", Unit: "\xc3"}},
		},
	}
}

// TestDecisionJSON: the hand-written encoder writes exactly what
// json.Marshal writes.
func TestDecisionJSON(t *testing.T) {
	for name, b := range decisionCases() {
		t.Run(name, func(t *testing.T) {
			want, err := json.Marshal(b)
			if err != nil {
				t.Fatal(err)
			}
			if got := b.appendJSON(nil); string(got) != string(want) {
				t.Fatalf("appendJSON = %s\nwant           %s", got, want)
			}
		})
	}
}

func FuzzDecisionJSON(f *testing.F) {
	for _, b := range decisionCases() {
		f.Add(b.RequestID, b.Detail, b.Reason, int64(b.Status), b.RetryAfterSeconds, b.Allowed)
	}
	f.Fuzz(func(t *testing.T, id, detail, name string, n, retry int64, allowed bool) {
		b := decisionBody{
			Type: name, Status: int(n), Detail: detail, ViolatedPolicies: []string{name, id}, Allowed: allowed, RequestID: id,
			DeniedBy: &limitRef{Scope: name, Name: detail, Endpoint: id}, Reason: detail, RetryAfterSeconds: retry,
			Limits: []limitJSON{{Scope: id, Name: name, Endpoint: detail, Unit: name, Limit: n, Used: retry, Remaining: -n, ResetSeconds: retry, Shadow: allowed}},
		}
		want, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		if got := b.appendJSON(nil); string(got) != string(want) {
			t.Fatalf("appendJSON = %s\nwant           %s", got, want)
		}
	})
}

// TestDateOf: the Date an answer gets is the one net/http would have
// written at that moment, in another second too (it is formatted again,
// not kept), and in another zone; within a second it is the value made
// for the second's first answer (the same slice), formatted once.
func TestDateOf(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 3, 59, 59, 900e6, time.FixedZone("X", 5*3600))
	var prev []string
	for i, now := range []time.Time{t0, t0.Add(50 * time.Millisecond), t0.Add(100 * time.Millisecond), t0.Add(26 * time.Hour), t0.Add(26*time.Hour + 1)} {
		want := now.UTC().Format(http.TimeFormat)
		got := dateOf(now)
		if len(got) != 1 || got[0] != want || cap(got) != 1 {
			t.Fatalf("dateOf(%v) = %q (cap %d), want [%q] (cap 1)", now, got, cap(got), want)
		}
		if sameSecond := i == 1 || i == 4; (prev != nil && &got[0] == &prev[0]) != sameSecond {
			t.Errorf("dateOf(%v) reused the value of the answer before: %v, want %v", now, !sameSecond, sameSecond)
		}
		prev = got
	}
}
