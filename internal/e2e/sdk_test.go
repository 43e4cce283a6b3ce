package e2e_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/llmtest"
)

// The LLM gateway mode with the official openai Node SDK as its client
// (testdata/sdk: the SDK pinned by package-lock.json, installed with npm
// ci), admission and the accounter as processes, in front of the stand-in
// LLM: what the SDK sees, and what lands in the ledger.

// sdkDir holds the SDK's package.json, lock file and the script the test runs.
const sdkDir = "testdata/sdk"

// node returns the path of node after installing the pinned SDK into
// sdkDir. Without node or npm the test skips, except in CI (CI=true), where
// deps provides them.
func node(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("node")
	npm, nerr := exec.LookPath("npm")
	if err != nil || nerr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("node or npm missing in CI (go tool task deps installs them): %v %v", err, nerr)
		}
		t.Skipf("node or npm missing (go tool task deps installs them): %v %v", err, nerr)
	}
	// Test binaries of several packages or checkouts may install at once:
	// one npm ci at a time per directory, skipped when the installed tree
	// is that of the lock file.
	lock, err := os.OpenFile(filepath.Join(sdkDir, ".install.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(filepath.Join(sdkDir, "package-lock.json"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(want)
	stamp := filepath.Join(sdkDir, "node_modules", ".quotaflow-lock-sha256")
	if got, _ := os.ReadFile(stamp); string(got) == hex.EncodeToString(sum[:]) {
		return bin
	}
	cmd := exec.Command(npm, "ci", "--no-audit", "--no-fund")
	cmd.Dir = sdkDir
	if cache, err := os.UserCacheDir(); err == nil {
		cmd.Env = append(os.Environ(), "npm_config_cache="+filepath.Join(cache, "quotaflow", "npm"))
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("npm ci in %s: %v\n%s", sdkDir, err, out)
	}
	if err := os.WriteFile(stamp, []byte(hex.EncodeToString(sum[:])), 0o600); err != nil {
		t.Fatal(err)
	}
	return bin
}

// sdkCall is one call as sdk.mjs reports it.
type sdkCall struct {
	Text  string
	Usage *struct {
		PromptTokens     int64 `json:"prompt_tokens"`
		CompletionTokens int64 `json:"completion_tokens"`
	}
	Remaining   string
	Error       string
	RateLimit   bool
	Status      int
	Code        string
	RetryAfter  string
	ShouldRetry string
	Message     string
}

// sdkPolicy: 1000 tokens per user.
const sdkPolicy = `
default_plan: llm
plans:
  llm:
    quotas: [{name: tokens, kind: rolling, window: 720h, limit: 1000}]
`

func TestOpenAINodeSDK(t *testing.T) {
	nodeBin := node(t)
	up := llmtest.Start(t)
	gw, err := e2e.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	const tenant = "sdk"
	s := startStack(t, stackConfig{policy: sdkPolicy, admission: []string{
		"QF_GATEWAY_ADDR=" + gw, "QF_GATEWAY_UPSTREAM=" + up.URL,
		"QF_GATEWAY_KEYS=key-alice=sdk/alice,key-dave=sdk/dave,key-erin=sdk/erin",
		// The default 10 ms sent 20 of the parallel step's 21 reserves to
		// the local limiter on a loaded host; the step checks Redis's
		// exact decisions.
		"QF_REDIS_TIMEOUT=2s",
	}})
	run := func(args ...string) *exec.Cmd {
		cmd := exec.Command(nodeBin, append([]string{"sdk.mjs"}, args...)...)
		cmd.Dir = sdkDir
		cmd.Env = append(os.Environ(), "QF_GATEWAY_URL=http://"+gw)
		cmd.Stderr = os.Stderr
		return cmd
	}
	call := func(key string, stream bool) sdkCall {
		t.Helper()
		out, err := run("chat", key, map[bool]string{false: "0", true: "1"}[stream]).Output()
		var c sdkCall
		if err != nil || json.Unmarshal(out, &c) != nil {
			t.Fatalf("sdk.mjs chat %s: %v\n%s", key, err, out)
		}
		return c
	}
	const prompt, completion = 17, 7 // what the stand-in reports
	up.Set(llmtest.Behaviour{PromptTokens: prompt, CompletionTokens: completion})

	// Normal and streaming calls: the SDK's usage is the stand-in's.
	first := call("key-alice", false)
	if first.Error != "" || first.Text != " hello hello hello hello hello" || first.Usage == nil ||
		first.Usage.PromptTokens != prompt || first.Usage.CompletionTokens != completion {
		t.Fatalf("chat = %+v", first)
	}
	remaining, err := strconv.ParseInt(first.Remaining, 10, 64)
	if err != nil {
		t.Fatalf("x-ratelimit-remaining %q: %v", first.Remaining, err)
	}
	estimate := 1000 - remaining // counted input + max_tokens 50
	input := estimate - 50
	if input <= 0 {
		t.Fatalf("estimate %d: below max_tokens", estimate)
	}
	if c := call("key-alice", true); c.Error != "" || c.Text != " hello hello hello hello hello" || c.Usage != nil {
		t.Errorf("stream = %+v, want five words and no usage chunk (not asked for)", c)
	}

	// A stream cut midway: the SDK sees two words; charged the input and two tokens.
	up.Set(llmtest.Behaviour{CutAfter: 2})
	if c := call("key-dave", true); c.Text != " hello hello" {
		t.Errorf("cut stream = %+v, want two words", c)
	}

	// Parallel calls: the stand-in holds every admitted one until all are
	// decided; exactly ⌊quota ÷ estimate⌋ are admitted. Each uses its whole
	// estimate, so the quota stays spent once the accounter corrects it.
	fits := 1000 / estimate
	n := fits + 5
	hold, arrived := make(chan struct{}), make(chan struct{}, n)
	up.Set(llmtest.Behaviour{PromptTokens: input, CompletionTokens: 50, Hold: hold, Arrived: arrived})
	before := len(up.Requests())
	m0 := scrape(t, s.admission)
	cmd := run("parallel", "key-erin", strconv.FormatInt(n, 10))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() }) // a failed check leaves it waiting
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var last string
	timeout := time.After(2 * time.Minute) // a bound on a hang, not a timing check
	for at, denied := int64(0), int64(0); at+denied < n; {
		select {
		case <-arrived:
			at++
		case l, ok := <-lines:
			if !ok || l != `{"denied":true}` {
				close(hold)
				t.Fatalf("sdk.mjs parallel: %q before all were decided (%d at the stand-in, %d denied)", l, at, denied)
			}
			denied++
		case <-timeout:
			close(hold)
			t.Fatalf("%d at the stand-in and %d denied of %d", at, denied, n)
		}
	}
	close(hold)
	for l := range lines {
		last = l
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("sdk.mjs parallel: %v", err)
	}
	var par struct {
		OK, Denied int64
		Other      []string
	}
	if err := json.Unmarshal([]byte(last), &par); err != nil || par.OK+par.Denied != n || len(par.Other) != 0 {
		t.Fatalf("parallel = %s (%v), want %d calls admitted or denied", last, err, n)
	}
	// What admission's metrics say of the step's n decisions: all of them
	// from Redis make the count exact; a call Redis did not answer within
	// QF_REDIS_TIMEOUT is decided locally (README, When something fails),
	// and one allowed so holds nothing in Redis until its actual is
	// charged, so Redis admits up to its limit beside it.
	dec := decisionsBetween(m0, scrape(t, s.admission))
	if dec.total() != n || dec.allowed() != par.OK {
		t.Errorf("parallel = %s; admission's metrics: %v; want %d decisions, as many allowed", last, dec, n)
	}
	if dec.localAllowed+dec.localDenied == 0 && par.OK != fits {
		t.Errorf("parallel = %s, want %d admitted and %d denied; admission's metrics: %v", last, fits, n-fits, dec)
	}
	if dec.redisAllowed > fits {
		t.Errorf("parallel = %s, Redis admitted %d, want at most %d; admission's metrics: %v", last, dec.redisAllowed, fits, dec)
	}
	if dec.localAllowed+dec.localDenied > 0 {
		t.Logf("parallel = %s with local decisions; admission's metrics: %v", last, dec)
	}
	if got := len(up.Requests()) - before; int64(got) != par.OK {
		t.Errorf("the stand-in received %d of the parallel calls, want the %d admitted", got, par.OK)
	}

	// A 429 is the SDK's RateLimitError, with retry-after.
	c := call("key-erin", false)
	if secs, err := strconv.Atoi(c.RetryAfter); !c.RateLimit || c.Status != 429 || c.Code != "rate_limit_exceeded" || err != nil || secs <= 0 {
		t.Errorf("past the quota = %+v, want RateLimitError with a retry-after in seconds", c)
	}
	if c.ShouldRetry != "" {
		t.Errorf("x-should-retry %q on a quota that frees up", c.ShouldRetry)
	}

	// The ledger, after the accounter: the stand-in's usage, call by call.
	want := map[string][2]int64{ // user: actual events, tokens
		"alice": {2, 2 * (prompt + completion)},
		"dave":  {1, input + 2},
		"erin":  {par.OK, par.OK * estimate},
	}
	for user, w := range want {
		e2e.EventuallyLast(t, user+"'s actual events in the ledger", func() (bool, string) {
			n, _ := s.actuals(t, tenant, user)
			return n >= w[0], strconv.FormatInt(n, 10) + " events"
		})
		if n, tokens := s.actuals(t, tenant, user); n != w[0] || tokens != w[1] {
			t.Errorf("ledger of %s: %d actual events, %d tokens; want %d, %d", user, n, tokens, w[0], w[1])
		}
	}
	// Redis agrees once the lost reserves of local decisions are voided:
	// each admitted call holds its actual, once.
	e2e.EventuallyLast(t, "erin's tokens in Redis", func() (bool, string) {
		used := s.as(t, "").used(tenant, "erin", "", "tokens")
		return used == par.OK*estimate, fmt.Sprintf("%d used, want %d", used, par.OK*estimate)
	})
}

// scrape reads every series of svc's /metrics.
func scrape(t *testing.T, svc *e2e.Service) []e2e.Sample {
	t.Helper()
	samples, err := e2e.Scrape(context.Background(), svc.Ops)
	if err != nil {
		t.Fatalf("%s metrics: %v", svc.Name, err)
	}
	return samples
}

// decisions is what admission's metrics counted between two scrapes: its
// decisions by Redis and without it (result="failopen", scope "none" when
// allowed), and what sends decisions to the local limiter.
type decisions struct {
	redisAllowed, redisDenied, localAllowed, localDenied int64
	// reserveErrors are Reserve calls that failed or timed out
	// (quotaflow_redis_errors_total); voids, by result, the lost ones made
	// to agree with a local decision; breaker its state at the second
	// scrape (0 closed, 2 open); calls went to Redis in batches round trips.
	reserveErrors, calls, batches int64
	voids                         string
	breaker                       float64
}

func decisionsBetween(before, after []e2e.Sample) decisions {
	delta := func(name string, labels ...string) int64 {
		return int64(e2e.Sum(after, name, labels...) - e2e.Sum(before, name, labels...))
	}
	const made = "quotaflow_admission_decisions_total"
	d := decisions{
		redisAllowed:  delta(made, "result", "allowed") + delta(made, "result", "shadow_denied"),
		redisDenied:   delta(made, "result", "denied"),
		localAllowed:  delta(made, "result", "failopen", "scope", "none"),
		reserveErrors: delta("quotaflow_redis_errors_total", "op", "reserve"),
		breaker:       e2e.Sum(after, "quotaflow_admission_breaker_state"),
		batches:       delta("quotaflow_admission_reserve_batch_size_count"),
		calls:         delta("quotaflow_admission_reserve_batch_size_sum"),
	}
	d.localDenied = delta(made, "result", "failopen") - d.localAllowed
	for _, r := range []string{"voided", "marked", "left", "retry", "dropped", "invalid"} {
		if n := delta("quotaflow_admission_reserve_voids_total", "result", r); n != 0 {
			d.voids += fmt.Sprintf(" %s=%d", r, n)
		}
	}
	if d.voids == "" {
		d.voids = " none"
	}
	return d
}

func (d decisions) total() int64 {
	return d.redisAllowed + d.redisDenied + d.localAllowed + d.localDenied
}

func (d decisions) allowed() int64 { return d.redisAllowed + d.localAllowed }

func (d decisions) String() string {
	return fmt.Sprintf("by Redis %d allowed, %d denied; locally %d allowed, %d denied; %d reserve errors; voids:%s; breaker %v; %d calls in %d reserve round trips",
		d.redisAllowed, d.redisDenied, d.localAllowed, d.localDenied, d.reserveErrors, d.voids, d.breaker, d.calls, d.batches)
}
