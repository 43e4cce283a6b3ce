package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// binariesEnv names a directory of admission and accounter binaries to
// test instead of building this tree's: pointed at binaries built from an
// older commit, the suite shows which of its tests fail there.
const binariesEnv = "QF_E2E_BINARIES"

// built holds the services compiled once for every test of the package.
var built struct {
	once sync.Once
	dir  string
	err  error
}

// TestMain removes the binaries built for the package's tests.
func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// binaries returns the directory of the service binaries: binariesEnv's,
// else this tree's, built at the first call.
func binaries(t *testing.T) string {
	t.Helper()
	if dir := os.Getenv(binariesEnv); dir != "" {
		return dir
	}
	built.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		root, err := e2e.ModuleRoot(ctx)
		if err != nil {
			built.err = err
			return
		}
		if built.dir, built.err = os.MkdirTemp("", "quotaflow-e2e-bin-"); built.err == nil {
			built.err = e2e.Build(ctx, root, built.dir)
		}
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.dir
}

// stackConfig is what a stack runs with besides its own Redis, database
// and streams.
type stackConfig struct {
	policy    string   // the policy YAML
	tokens    []string // QF_API_TOKENS entries
	admission []string // more environment of admission
	accounter []string // more environment of the accounter
	redisArgs []string // more redis-server arguments
	instances int      // admission processes on the one Redis; 0 means 1
}

// stack is admission and the accounter run as processes, on a redis-server
// of their own, a database of their own on the shared Postgres and streams
// and a subject prefix of their own on the shared NATS.
//
// The Redis is private because the accounter's reconciliation walks every
// subject of its Redis and repairs each against its own ledger: on the
// shared Redis it would compare (and "repair") other tests' tenants, and
// its drift gauge would measure them too.
type stack struct {
	api       string // admission's base URL
	admission *e2e.Service
	// apis and admissions are every admission instance's, the first
	// being api and admission.
	apis       []string
	admissions []*e2e.Service
	accounter  *e2e.Service
	redis      *e2e.Server   // the private Redis, which a test may crash
	rdb        *redis.Client // a client of it
	db         *pgxpool.Pool // the accounter's ledger
	js         jetstream.JetStream
	streams    stream.Config
}

// startStack starts a stack for the test and stops it at cleanup, logging
// the services' last lines when the test failed.
func startStack(t *testing.T, cfg stackConfig) *stack {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bin := binaries(t)
	dir := t.TempDir()
	rs, err := e2e.StartRedis(ctx, dir, cfg.redisArgs...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rs.Close)
	opt, err := redis.ParseURL(rs.URL)
	if err != nil {
		t.Fatal(err)
	}
	s := &stack{redis: rs, rdb: redis.NewClient(opt)}
	t.Cleanup(func() { s.rdb.Close() })

	dbURL := pgtest.NewDatabase(t, "qfhostile")
	if s.db, err = pgxpool.New(ctx, dbURL); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.db.Close)
	_, s.js = natstest.Connect(t, natstest.URL(), nats.Name(t.Name()))
	s.streams = natstest.Streams(t, s.js, "hostile", stream.Config{})

	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte(cfg.policy), 0o600); err != nil {
		t.Fatal(err)
	}
	sc := s.streams
	common := []string{
		"QF_REDIS_URL=" + rs.URL, "QF_NATS_URL=" + natstest.URL(), "QF_POLICY_FILE=" + policy,
		"QF_STREAM=" + sc.Stream, "QF_DLQ_STREAM=" + sc.DLQStream, "QF_SUBJECT_PREFIX=" + sc.SubjectPrefix,
		"QF_STREAM_MAX_AGE=" + sc.MaxAge.String(), "QF_STREAM_DUPLICATES=" + sc.Duplicates.String(),
		"QF_DLQ_MAX_AGE=" + sc.DLQMaxAge.String(), "QF_LOG_LEVEL=info", "QF_SHUTDOWN_TIMEOUT=5s",
	}
	// Every ops port, the console's and each admission's API, chosen at once.
	instances := max(1, cfg.instances)
	addrs, err := e2e.FreeAddrs(2 + 2*instances)
	if err != nil {
		t.Fatal(err)
	}
	start := func(name, binary, ops string, env []string) *e2e.Service {
		env = append(append(append([]string{}, common...), "QF_OPS_ADDR="+ops), env...)
		svc, err := e2e.Start(name, filepath.Join(bin, binary), dir, ops, env)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := svc.Stop(20 * time.Second); err != nil {
				t.Logf("%s: %v", name, err)
			}
			if t.Failed() {
				t.Logf("%s log (last lines):\n%s", name, e2e.Tail(svc.LogPath, 40))
			}
		})
		return svc
	}
	// The accounter first: it writes the epoch that lets admission decide
	// from a brand-new Redis.
	s.accounter = start("accounter", "accounter", addrs[0], append([]string{"QF_POSTGRES_URL=" + dbURL, "QF_CONSOLE_ADDR=" + addrs[1],
		"QF_BATCH_WAIT=20ms", "QF_EPOCH_INTERVAL=1s"}, cfg.accounter...))
	for i := range instances {
		name, ops, apiAddr := "admission", addrs[2+2*i], addrs[3+2*i]
		if i > 0 {
			name = fmt.Sprintf("admission-%d", i+1)
		}
		s.apis = append(s.apis, "http://"+apiAddr)
		s.admissions = append(s.admissions, start(name, "admission", ops, append([]string{"QF_ADMISSION_ADDR=" + apiAddr,
			"QF_API_TOKENS=" + strings.Join(cfg.tokens, ","), "QF_SPILL_DIR=" + filepath.Join(dir, "spill", name)}, cfg.admission...)))
	}
	s.api, s.admission = s.apis[0], s.admissions[0]
	for _, svc := range append([]*e2e.Service{s.accounter}, s.admissions...) {
		if err := svc.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, a := range s.admissions {
		if deg := a.WaitSteady(ctx, 30*time.Second); deg != "" {
			t.Fatalf("%s still degraded: %s", a.Name, deg)
		}
	}
	return s
}

// metric sums the series of name with labels (key, value pairs) on svc's
// ops port.
func metric(t *testing.T, svc *e2e.Service, name string, labels ...string) float64 {
	t.Helper()
	v, err := svc.Metric(context.Background(), name, labels...)
	if err != nil {
		t.Fatalf("%s metrics: %v", svc.Name, err)
	}
	return v
}

// reply is an HTTP answer.
type reply struct {
	code int
	hdr  http.Header
	body []byte
}

func (r reply) String() string { return fmt.Sprintf("%d %s", r.code, bytes.TrimSpace(r.body)) }

// decode unmarshals the body into v, failing the test if it is not JSON.
func (r reply) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("answer %s: %v", r, err)
	}
}

// caller is admission's HTTP API as a caller holding token sees it.
type caller struct {
	t     *testing.T
	base  string
	token string // "" sends no Authorization header
}

func (s *stack) as(t *testing.T, token string) caller { return caller{t: t, base: s.api, token: token} }

var httpClient = &http.Client{Timeout: 10 * time.Second}

// do sends a request with body (JSON-encoded unless a string) and headers
// (name, value pairs).
func (c caller) do(method, path string, body any, hdr ...string) reply {
	c.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		raw, err := json.Marshal(b)
		if err != nil {
			c.t.Fatal(err)
		}
		rd = bytes.NewReader(raw)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		c.t.Fatal(err)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	return reply{code: resp.StatusCode, hdr: resp.Header, body: raw}
}

// admitReq is the body of POST /v1/admit.
type admitReq struct {
	RequestID string `json:"request_id,omitempty"`
	Tenant    string `json:"tenant"`
	User      string `json:"user"`
	Plan      string `json:"plan,omitempty"`
	Endpoint  string `json:"endpoint"`
	Estimate  int64  `json:"estimated_tokens"`
}

// limitState is one limit of an answer.
type limitState struct {
	Scope     string `json:"scope"`
	Name      string `json:"name"`
	Endpoint  string `json:"endpoint"`
	Unit      string `json:"unit"`
	Limit     int64  `json:"limit"`
	Used      int64  `json:"used"`
	Remaining int64  `json:"remaining"`
}

// decision is the body of an admit or authz answer.
type decision struct {
	Allowed   bool         `json:"allowed"`
	RequestID string       `json:"request_id"`
	Reason    string       `json:"reason"`
	Limits    []limitState `json:"limits"`
}

func (c caller) admit(r admitReq) reply {
	c.t.Helper()
	return c.do(http.MethodPost, "/v1/admit", r)
}

// release posts /v1/release and returns its status field.
func (c caller) release(tenant, user, requestID string) (reply, string) {
	c.t.Helper()
	r := c.do(http.MethodPost, "/v1/release", map[string]string{"tenant": tenant, "user": user, "request_id": requestID})
	var a struct {
		Status string `json:"status"`
	}
	if r.code == http.StatusOK {
		r.decode(c.t, &a)
	}
	return r, a.Status
}

// usage returns GET /v1/usage's limits by name, failing the test unless
// it answers 200.
func (c caller) usage(tenant, user, plan string) map[string]limitState {
	c.t.Helper()
	q := "/v1/usage?tenant=" + tenant + "&user=" + user
	if plan != "" {
		q += "&plan=" + plan
	}
	// 503 is Redis out of reach for a moment (a test may make it slow):
	// asked again.
	var r reply
	e2e.EventuallyLast(c.t, "GET "+q, func() (bool, string) {
		r = c.do(http.MethodGet, q, nil)
		return r.code != http.StatusServiceUnavailable, r.String()
	})
	if r.code != http.StatusOK {
		c.t.Fatalf("GET %s = %s", q, r)
	}
	var a struct {
		Limits []limitState `json:"limits"`
	}
	r.decode(c.t, &a)
	m := map[string]limitState{}
	for _, l := range a.Limits {
		m[l.Name] = l
	}
	return m
}

// used is what limit name of the subject holds, per GET /v1/usage.
func (c caller) used(tenant, user, plan, name string) int64 {
	c.t.Helper()
	l, ok := c.usage(tenant, user, plan)[name]
	if !ok {
		c.t.Fatalf("GET /v1/usage of %s/%s (plan %q) has no limit %q", tenant, user, plan, name)
	}
	return l.Used
}

// actualEvent is a usage CloudEvent of type actual, as a service reports
// it; id is the caller's event id (admission ignores it now; older
// versions required it).
func actualEvent(id, tenant, user, requestID string, input, output int64, at time.Time) map[string]any {
	return map[string]any{
		"specversion": "1.0", "id": id, "source": "hostile-test", "type": events.TypeActual,
		"time": at.UTC().Format(time.RFC3339Nano), "datacontenttype": "application/json",
		"data": map[string]any{"request_id": requestID, "tenant": tenant, "user": user,
			"input_tokens": input, "output_tokens": output},
	}
}

// report posts events to POST /v1/usage.
func (c caller) report(evs ...map[string]any) reply {
	c.t.Helper()
	return c.do(http.MethodPost, "/v1/usage", evs)
}

// publishRaw publishes body straight to the usage stream as a service on
// NATS does, with msgID as its Nats-Msg-Id, bypassing every check of
// admission and of stream.Publisher.
func (s *stack) publishRaw(t *testing.T, typ, msgID string, body []byte) {
	t.Helper()
	m := nats.NewMsg(events.Subject(s.streams.SubjectPrefix, typ))
	m.Data = body
	m.Header.Set(jetstream.MsgIDHeader, msgID)
	m.Header.Set("Content-Type", events.ContentType)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.js.PublishMsg(ctx, m); err != nil {
		t.Fatalf("publish %s: %v", msgID, err)
	}
}

// messages returns the messages of stream on subject (wildcards allowed),
// oldest first.
func (s *stack) messages(t *testing.T, stream, subject string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := uint64(1); ; {
		m, err := st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return out
		}
		if err != nil {
			t.Fatalf("stream %s: %v", stream, err)
		}
		out = append(out, m)
		seq = m.Sequence + 1
	}
}

// deadLetters returns every dead letter, oldest first.
func (s *stack) deadLetters(t *testing.T) []*jetstream.RawStreamMsg {
	t.Helper()
	return s.messages(t, s.streams.DLQStream, events.DLQSubjects(s.streams.SubjectPrefix))
}

// deadLetteredOnce waits until the message published with msgID is
// dead-lettered, and checks that it was so once, for reason.
func (s *stack) deadLetteredOnce(t *testing.T, msgID, reason string) {
	t.Helper()
	var subjects []string
	e2e.EventuallyLast(t, msgID+" dead-lettered", func() (bool, string) {
		subjects = subjects[:0]
		for _, m := range s.deadLetters(t) {
			if m.Header.Get(stream.HeaderMsgID) == msgID {
				subjects = append(subjects, m.Subject)
			}
		}
		return len(subjects) > 0, "none"
	})
	if want := events.DLQSubject(s.streams.SubjectPrefix, reason); len(subjects) != 1 || subjects[0] != want {
		t.Errorf("%s dead-lettered on %q, want once on %s", msgID, subjects, want)
	}
}

// retries is how many events the accounter's consumer left for
// redelivery.
func (s *stack) retries(t *testing.T) float64 {
	t.Helper()
	return metric(t, s.accounter, "quotaflow_accounter_events_total", "result", "retry")
}

// repaired is how many tokens the accounter's reconciliation repaired.
func (s *stack) repaired(t *testing.T) float64 {
	t.Helper()
	return metric(t, s.accounter, "quotaflow_accounter_repaired_tokens_total")
}

// reconcilesClean waits for two reconciliations and checks that they find
// no drift and repair nothing: repaired0 is s.repaired before the test.
func (s *stack) reconcilesClean(t *testing.T, repaired0 float64) {
	t.Helper()
	s.reconciled(t)
	if d := metric(t, s.accounter, "quotaflow_accounter_drift_tokens"); d != 0 {
		t.Errorf("reconciliation found a drift of %v tokens, want 0", d)
	}
	if r := s.repaired(t); r != repaired0 {
		t.Errorf("reconciliation repaired %v tokens, want 0", r-repaired0)
	}
}

// count runs a query returning one number on the ledger.
func (s *stack) count(t *testing.T, query string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := s.db.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("ledger: %s: %v", query, err)
	}
	return n
}

// actuals is how many actual events of tenant's user the ledger holds,
// and their tokens.
func (s *stack) actuals(t *testing.T, tenant, user string) (n, tokens int64) {
	t.Helper()
	const q = `SELECT count(actual_tokens), coalesce(sum(actual_tokens), 0)::bigint FROM reservations
WHERE tenant = $1 AND user_id = $2`
	if err := s.db.QueryRow(context.Background(), q, tenant, user).Scan(&n, &tokens); err != nil {
		t.Fatalf("ledger: %v", err)
	}
	return n, tokens
}

// reservation is the ledger's row of a reservation: its status and actual
// tokens (-1 when none); status is "" when there is no row.
func (s *stack) reservation(t *testing.T, tenant, user, requestID string) (status string, actual int64) {
	t.Helper()
	const q = `SELECT status, coalesce(actual_tokens, -1) FROM reservations WHERE tenant = $1 AND user_id = $2 AND request_id = $3`
	err := s.db.QueryRow(context.Background(), q, tenant, user, requestID).Scan(&status, &actual)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("ledger: %v", err)
	}
	return status, actual
}

// reconciled waits until the accounter's reconciliation has completed
// three more passes: a drift present when it is called would have been
// repaired by then, since a repair needs the same drift in two consecutive
// scans and a recheck.
func (s *stack) reconciled(t *testing.T) {
	t.Helper()
	runs := func() float64 {
		return metric(t, s.accounter, "quotaflow_accounter_reconciliations_total", "result", "ok")
	}
	from := runs()
	e2e.EventuallyLast(t, "three reconciliations", func() (bool, string) {
		n := runs()
		return n >= from+3, fmt.Sprintf("%v since the call", n-from)
	})
}
