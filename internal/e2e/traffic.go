package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/pkg/events"
)

// User is one simulated end user: how much each request is estimated at
// and how many requests it sends per round.
type User struct {
	Tenant, Name string
	Estimate     int64 // mean estimate in tokens
	Burst        int   // requests per round
}

// Stats is what the generator did, counted as it goes.
type Stats struct {
	Admits, Allowed, Denied, Status5xx, OtherStatus atomic.Int64
	Reserved                                        atomic.Int64 // estimates of allowed admits
	ActualSent, ActualEvents                        atomic.Int64 // accepted (202) actual events
	Releases, ReleasedTokens                        atomic.Int64
	Failed                                          atomic.Int64 // transport errors, given-up reports

	mu       sync.Mutex
	deniedBy map[string]int // violated policy → 429s
	errs     map[string]int // "route status" or "route: error" → count, for every 5xx, unexpected status and failure
	caused   map[[2]string]*caused
}

// caused bounds the usage one (tenant, user)'s traffic can have put in any
// of its windows: every admitted request, at its estimate or its actual
// cost when that was higher.
type caused struct{ tokens, requests int64 }

// cause adds an admitted request's share to u's bound: tokens, and
// requests admitted.
func (s *Stats) cause(u User, tokens, requests int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := [2]string{u.Tenant, u.Name}
	c := s.caused[k]
	if c == nil {
		c = &caused{}
		s.caused[k] = c
	}
	c.tokens += tokens
	c.requests += requests
}

// Unfounded returns the threshold alerts that claim more usage than the
// traffic can have caused: more tokens than its admitted requests cost
// (estimate, or actual when higher), or more requests than it had
// admitted, for the alert's user, or summed over the tenant's users for a
// tenant-wide limit. An alert from made-up usage (a decision admission
// took without Redis, reporting limit minus a local allowance as used)
// shows up here; real ones never do.
func (s *Stats) Unfounded(alerts []ThresholdAlert) []ThresholdAlert {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []ThresholdAlert
	for _, a := range alerts {
		var c caused
		for k, v := range s.caused {
			if k[0] == a.Tenant && (a.User == "" || k[1] == a.User) {
				c.tokens += v.tokens
				c.requests += v.requests
			}
		}
		bound := c.requests
		if a.Unit == "tokens" {
			bound = c.tokens
		}
		if a.Used > bound {
			out = append(out, a)
		}
	}
	return out
}

func (s *Stats) unexpected(path string, code int) {
	s.mu.Lock()
	s.errs[fmt.Sprintf("%s %d", path, code)]++
	s.mu.Unlock()
}

// fail counts a request that failed for good, and why.
func (s *Stats) fail(what string) {
	s.Failed.Add(1)
	s.mu.Lock()
	s.errs[what]++
	s.mu.Unlock()
}

func (s *Stats) deny(policy string) {
	s.mu.Lock()
	s.deniedBy[policy]++
	s.mu.Unlock()
}

// DeniedBy returns the 429s by violated policy.
func (s *Stats) DeniedBy() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := map[string]int{}
	for k, v := range s.deniedBy {
		m[k] = v
	}
	return m
}

// Generator plays a gateway (admits) and an LLM service (reports the
// actual usage, or a release) against admission. It only talks to the
// admission URLs it is given, which are on 127.0.0.1.
type Generator struct {
	Base, Token, Endpoint string // admission's URL, bearer token, the endpoint admitted
	// Peers are more admission instances' URLs. Requests are spread over
	// Base and Peers, and one that fails in transport (the instance is
	// down, or died with it in flight) goes to the next at once, as a
	// gateway's load balancer does: every request the generator sends is
	// idempotent (an admit by its request id while its reservation is
	// open, a release, a usage event by its id).
	Peers  []string
	Run    string // prefix of the request ids
	Client *http.Client
	St     *Stats
	// Patience is how long a usage report or a release is resent after a
	// 503 or a transport error before it counts as failed.
	Patience time.Duration
	// Latency, when set, is told every admit's latency and status.
	Latency func(d time.Duration, status int)
	// OnAllow, when set, is told every allowed admit once its answer came:
	// the user, the request id, the estimate reserved and the admission
	// URL (Base or a peer) that answered.
	OnAllow func(u User, requestID string, estimate int64, by string)
	// Publish, when set, reports actual usage as a service that publishes
	// to NATS itself does (resent after an error for up to Patience);
	// otherwise it goes through admission's POST /v1/usage.
	Publish func(ctx context.Context, ev events.Event) error

	seq  atomic.Int64
	next atomic.Uint64 // round robin over Base and Peers
}

// Play runs rounds spread over d, every user concurrently, then returns.
func (g *Generator) Play(ctx context.Context, us []User, rounds int, d time.Duration) {
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
				for b := 0; b < u.Burst && ctx.Err() == nil; b++ {
					g.request(ctx, rng, u)
				}
			}
		}()
	}
	wg.Wait()
}

// request admits one request and, when allowed, reports what it cost.
func (g *Generator) request(ctx context.Context, rng *rand.Rand, u User) {
	est := u.Estimate/2 + rng.Int64N(u.Estimate+1) // mean ≈ u.Estimate
	id := fmt.Sprintf("%s-%06d", g.Run, g.seq.Add(1))
	body, _ := json.Marshal(map[string]any{
		"request_id": id, "tenant": u.Tenant, "user": u.Name,
		"endpoint": g.Endpoint, "estimated_tokens": est,
	})
	g.St.Admits.Add(1)
	t0 := time.Now()
	// An admit in flight when the traffic stops is finished: cut short, it
	// could leave a reservation no report ever settles.
	code, resp, by, err := g.post(context.WithoutCancel(ctx), "/v1/admit", body)
	if g.Latency != nil && err == nil {
		g.Latency(time.Since(t0), code)
	}
	switch {
	case err != nil:
		g.St.fail("/v1/admit: " + err.Error())
		return
	case code == http.StatusOK:
		g.St.Allowed.Add(1)
		g.St.Reserved.Add(est)
		g.St.cause(u, est, 1)
		if g.OnAllow != nil {
			g.OnAllow(u, id, est, by)
		}
	case code == http.StatusTooManyRequests:
		g.St.Denied.Add(1)
		var p struct {
			Violated []string `json:"violated-policies"`
			Reason   string   `json:"reason"`
		}
		_ = json.Unmarshal(resp, &p)
		g.St.deny(strings.Join(p.Violated, ","))
		return
	default:
		return // counted by post
	}
	// Once admitted, the request is reported even when the traffic stops
	// meanwhile: a report abandoned after JetStream stored it would be in
	// the ledger but not in the counts.
	ctx = context.WithoutCancel(ctx)
	// The LLM call: one in ten fails before using tokens (release); the
	// others cost 0.5 to 1.2 times the estimate, as real completions
	// rarely match their estimate.
	if rng.IntN(10) == 0 {
		rb, _ := json.Marshal(map[string]string{"tenant": u.Tenant, "user": u.Name, "request_id": id})
		// 202: queued for the accounter while Redis is unreachable.
		if g.retry(ctx, "/v1/release", rb, http.StatusOK, http.StatusAccepted) {
			g.St.Releases.Add(1)
			g.St.ReleasedTokens.Add(est)
		} else {
			g.St.fail("/v1/release: given up")
		}
		return
	}
	actual := est * int64(50+rng.IntN(71)) / 100
	// Counted whether or not the report gets through: one that failed
	// may still have been stored.
	g.St.cause(u, max(0, actual-est), 0)
	in := actual * 2 / 5
	ev := events.NewActual("quotaflow-demo", events.Actual{
		RequestID: id, Tenant: u.Tenant, User: u.Name, Endpoint: g.Endpoint,
		InputTokens: in, OutputTokens: actual - in,
	}, time.Now())
	if g.report(ctx, ev) {
		g.St.ActualSent.Add(actual)
		g.St.ActualEvents.Add(1)
	} else {
		g.St.fail("actual usage report: given up")
	}
}

// report sends the actual usage event ev until it is stored, resending
// after a failure (its id dedups) for up to g.Patience.
func (g *Generator) report(ctx context.Context, ev events.Event) bool {
	if g.Publish == nil {
		eb, err := json.Marshal([]events.Event{ev})
		// 503 means JetStream did not store it: resend.
		return err == nil && g.retry(ctx, "/v1/usage", eb, http.StatusAccepted)
	}
	return g.persist(ctx, func() (ok, again bool) {
		err := g.Publish(ctx, ev)
		return err == nil, !errors.Is(err, events.ErrInvalid)
	})
}

// retry posts body until it gets a status in want, resending after a 503
// or a transport error for up to g.Patience; it reports whether want came.
// The resends are safe: a release is idempotent and a usage event's id
// makes JetStream drop a copy it already stored.
func (g *Generator) retry(ctx context.Context, path string, body []byte, want ...int) bool {
	return g.persist(ctx, func() (ok, again bool) {
		code, _, _, err := g.post(ctx, path, body)
		return err == nil && slices.Contains(want, code), err != nil || code == http.StatusServiceUnavailable
	})
}

// persist calls try until it succeeds or fails for good, pausing between
// tries, for up to g.Patience.
func (g *Generator) persist(ctx context.Context, try func() (ok, again bool)) bool {
	deadline := time.Now().Add(g.Patience)
	for {
		ok, again := try()
		if ok || !again || time.Now().After(deadline) {
			return ok
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// post sends body to path on an admission instance and returns the
// status, the body and the instance's base URL.
func (g *Generator) post(ctx context.Context, path string, body []byte) (int, []byte, string, error) {
	bases := append([]string{g.Base}, g.Peers...)
	first := int(g.next.Add(1) % uint64(len(bases)))
	var resp *http.Response
	var err error
	var base string
	for i := range bases {
		base = bases[(first+i)%len(bases)]
		var req *http.Request
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
		if err != nil {
			return 0, nil, "", err
		}
		req.Header.Set("Authorization", "Bearer "+g.Token)
		req.Header.Set("Content-Type", "application/json")
		if resp, err = g.Client.Do(req); err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	switch {
	case resp.StatusCode >= 500:
		g.St.Status5xx.Add(1)
		g.St.unexpected(path, resp.StatusCode)
	case resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusAccepted && resp.StatusCode != http.StatusTooManyRequests:
		g.St.OtherStatus.Add(1)
		g.St.unexpected(path, resp.StatusCode)
	}
	return resp.StatusCode, b, base, nil
}

// NewStats returns empty Stats.
func NewStats() *Stats {
	return &Stats{deniedBy: map[string]int{}, errs: map[string]int{}, caused: map[[2]string]*caused{}}
}

// Unexpected returns the 5xx and unexpected statuses by "route status"
// and the failures by "route: error".
func (s *Stats) Unexpected() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[string]int, len(s.errs))
	for k, v := range s.errs {
		m[k] = v
	}
	return m
}
