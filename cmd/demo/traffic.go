package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/pkg/events"
)

// user is one simulated end user: how much each request is estimated at
// and how many requests it sends per round.
type user struct {
	tenant, name string
	estimate     int64 // mean estimate in tokens
	burst        int   // requests per round
}

// users: per tenant a light user (stays under 80 %), a medium one (crosses
// 80/90 %) and a heavy one (reaches the 5 h quota and gets 429s); two
// tenants also have a script hammering small requests, which runs the
// token bucket and the endpoint's daily limit dry.
func demoUsers(n names) []user {
	var us []user
	for i, t := range n.tenants {
		us = append(us,
			user{t, "light", 200, 1},
			user{t, "medium", 600, 1},
			user{t, "heavy", 1000, 1})
		if i < 2 {
			us = append(us, user{t, "script", 40, 12})
		}
	}
	return us
}

// stats is what the generator did, counted as it goes.
type stats struct {
	admits, allowed, denied, status5xx, otherStatus atomic.Int64
	reserved                                        atomic.Int64 // estimates of allowed admits
	actualSent, actualEvents                        atomic.Int64 // accepted (202) actual events
	releases, releasedTokens                        atomic.Int64
	failed                                          atomic.Int64 // transport errors, given-up reports

	mu       sync.Mutex
	deniedBy map[string]int // violated policy → 429s
	errs     map[string]int // "route status" → count, for every 5xx and unexpected status
}

func (s *stats) unexpected(path string, code int) {
	s.mu.Lock()
	s.errs[fmt.Sprintf("%s %d", path, code)]++
	s.mu.Unlock()
}

func (s *stats) deny(policy string) {
	s.mu.Lock()
	s.deniedBy[policy]++
	s.mu.Unlock()
}

func (s *stats) deniedByCopy() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := map[string]int{}
	for k, v := range s.deniedBy {
		m[k] = v
	}
	return m
}

// generator plays a gateway (admits) and an LLM service (reports the
// actual usage, or a release) against admission. It only talks to the
// admission URL it is given, which is on 127.0.0.1.
type generator struct {
	base, token, endpoint, run string
	client                     *http.Client
	st                         *stats
	seq                        atomic.Int64
}

// play runs rounds spread over d, every user concurrently, then returns.
func (g *generator) play(ctx context.Context, us []user, rounds int, d time.Duration) {
	interval := d / time.Duration(rounds)
	t0 := time.Now()
	var wg sync.WaitGroup
	for i, u := range us {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), uint64(t0.UnixNano())))
			// Spread users over the interval so they do not fire in step.
			offset := time.Duration(rng.Int64N(int64(interval) + 1))
			for r := 0; r < rounds; r++ {
				wait := time.Until(t0.Add(offset + time.Duration(r)*interval))
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
				for b := 0; b < u.burst && ctx.Err() == nil; b++ {
					g.request(ctx, rng, u)
				}
			}
		}()
	}
	wg.Wait()
}

// request admits one request and, when allowed, reports what it cost.
func (g *generator) request(ctx context.Context, rng *rand.Rand, u user) {
	est := u.estimate/2 + rng.Int64N(u.estimate+1) // mean ≈ u.estimate
	id := fmt.Sprintf("%s-%06d", g.run, g.seq.Add(1))
	body, _ := json.Marshal(map[string]any{
		"request_id": id, "tenant": u.tenant, "user": u.name,
		"endpoint": g.endpoint, "estimated_tokens": est,
	})
	g.st.admits.Add(1)
	code, resp, err := g.post(ctx, "/v1/admit", body)
	switch {
	case err != nil:
		g.st.failed.Add(1)
		return
	case code == http.StatusOK:
		g.st.allowed.Add(1)
		g.st.reserved.Add(est)
	case code == http.StatusTooManyRequests:
		g.st.denied.Add(1)
		var p struct {
			Violated []string `json:"violated-policies"`
			Reason   string   `json:"reason"`
		}
		_ = json.Unmarshal(resp, &p)
		g.st.deny(strings.Join(p.Violated, ","))
		return
	default:
		return // counted by post
	}
	// The LLM call: one in ten fails before using tokens (release); the
	// others cost 0.5 to 1.2 times the estimate, as real completions
	// rarely match their estimate.
	if rng.IntN(10) == 0 {
		rb, _ := json.Marshal(map[string]string{"tenant": u.tenant, "user": u.name, "request_id": id})
		// 503: Redis unreachable; a release is safe to retry.
		if g.retry(ctx, "/v1/release", rb, http.StatusOK) {
			g.st.releases.Add(1)
			g.st.releasedTokens.Add(est)
		} else {
			g.st.failed.Add(1)
		}
		return
	}
	actual := est * int64(50+rng.IntN(71)) / 100
	in := actual * 2 / 5
	ev := events.NewActual("quotaflow-demo", events.Actual{
		RequestID: id, Tenant: u.tenant, User: u.name, Endpoint: g.endpoint,
		InputTokens: in, OutputTokens: actual - in,
	}, time.Now())
	eb, err := json.Marshal([]events.Event{ev})
	if err != nil {
		g.st.failed.Add(1)
		return
	}
	// 503 means JetStream did not store it: resend (the event id dedups).
	if g.retry(ctx, "/v1/usage", eb, http.StatusAccepted) {
		g.st.actualSent.Add(actual)
		g.st.actualEvents.Add(1)
	} else {
		g.st.failed.Add(1)
	}
}

// retry posts body until it gets want, resending after a 503 or a
// transport error (a few times); it reports whether want came.
func (g *generator) retry(ctx context.Context, path string, body []byte, want int) bool {
	for try := 0; try < 5 && ctx.Err() == nil; try++ {
		code, _, err := g.post(ctx, path, body)
		if err == nil && code == want {
			return true
		}
		if err == nil && code != http.StatusServiceUnavailable {
			return false
		}
		time.Sleep(200 * time.Millisecond)
	}
	return false
}

func (g *generator) post(ctx context.Context, path string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+g.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	switch {
	case resp.StatusCode >= 500:
		g.st.status5xx.Add(1)
		g.st.unexpected(path, resp.StatusCode)
	case resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusAccepted && resp.StatusCode != http.StatusTooManyRequests:
		g.st.otherStatus.Add(1)
		g.st.unexpected(path, resp.StatusCode)
	}
	return resp.StatusCode, b, nil
}

// sortedKeys returns m's keys in order, for stable output.
func sortedKeys[K interface{ ~string | ~int }, V any](m map[K]V) []K {
	ks := make([]K, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i] < ks[j] })
	return ks
}
