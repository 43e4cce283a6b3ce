package main

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"quotaflow/internal/envoypeer"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events/stream"
)

// rlsSide is a ShouldRateLimit server under comparison and the private
// Redis it counts in, emptied before each sequence.
type rlsSide struct {
	rls   rlpb.RateLimitServiceClient
	md    metadata.MD
	redis *redis.Client
}

func (s *rlsSide) ask(c call) (*rlpb.RateLimitResponse, error) {
	ctx, cancel := context.WithTimeout(metadata.NewOutgoingContext(context.Background(), s.md), 10*time.Second)
	defer cancel()
	return s.rls.ShouldRateLimit(ctx, c.request())
}

func dialRLS(t *testing.T, addr string) rlpb.RateLimitServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return rlpb.NewRateLimitServiceClient(conn)
}

// startPeer runs the pinned envoyproxy/ratelimit with the YAML files of
// confDir on a private Redis.
func startPeer(t *testing.T, confDir string) *rlsSide {
	t.Helper()
	bin, err := envoypeer.Binary()
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(confDir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no YAML files in %s (%v)", confDir, err)
	}
	configs := map[string][]byte{}
	for _, f := range files {
		if configs[filepath.Base(f)], err = os.ReadFile(f); err != nil {
			t.Fatal(err)
		}
	}
	rs := redistest.Start(t)
	dir := t.TempDir()
	env, addrs, err := envoypeer.Setup(dir, configs, envoypeer.Settings{RedisAddr: rs.Addr, Extra: []string{"LIMIT_RESPONSE_HEADERS_ENABLED=true"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := envoypeer.Start(ctx, bin, dir, env, addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return &rlsSide{rls: dialRLS(t, addrs.GRPC), redis: rs.Client()}
}

// startAdmission runs admission with QF_ENVOY_RATELIMIT_CONFIG=confDir,
// QF_ENVOY_TENANT_KEYS and QF_ENVOY_USER_KEYS on a private Redis, with a
// generous Redis deadline (every decision Redis's, even under -race on a
// busy machine).
func startAdmission(t *testing.T, confDir string, tenantKeys, userKeys []string) *rlsSide {
	t.Helper()
	rs := redistest.Start(t)
	cfg := testConfig(t)
	cfg.RedisURL = "redis://" + rs.Addr + "/0"
	cfg.RedisTimeout = 5 * time.Second
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, "envoydiff", stream.Config{})
	cfg.GRPCAddr, cfg.EnvoyRateLimitConfig = "127.0.0.1:0", confDir
	cfg.APITokens = []string{"envoydiff-token#gateway"}
	cfg.EnvoyRateLimitHeaders = true
	cfg.EnvoyTenantKeys, cfg.EnvoyUserKeys = tenantKeys, userKeys
	a, done, cancel := startRunAddrs(t, cfg, slog.New(slog.DiscardHandler))
	t.Cleanup(func() { cancel(); <-done })
	return &rlsSide{rls: dialRLS(t, a.grpc), md: metadata.Pairs("authorization", "Bearer envoydiff-token"), redis: rs.Client()}
}

// sequence is calls that run in one window of every limit they reach.
type sequence struct {
	name  string
	calls []string
}

// runSequence sends seq's calls to the peer and to admission in turn, on
// emptied Redis servers, and checks the peer's
// answers against the model's envoy half and admission's against its
// quotaflow half. A sequence that straddled a window boundary of a limit
// it reached is run again, from the start of a fresh window.
func runSequence(t *testing.T, peer, qf *rlsSide, seq sequence) {
	t.Helper()
	calls := make([]call, len(seq.calls))
	for i, s := range seq.calls {
		c, err := parseCall(s)
		if err != nil {
			t.Fatalf("%s: %v", seq.name, err)
		}
		calls[i] = c
	}
	for attempt := 1; ; attempt++ {
		var problems []string
		unit, crossed := runOnce(t, peer, qf, calls, &problems)
		if !crossed {
			for _, p := range problems {
				t.Errorf("%s: %s", seq.name, p)
			}
			return
		}
		if attempt == 3 {
			t.Fatalf("%s: three runs straddled a window boundary of %v", seq.name, unit)
		}
		waitWindow(unit)
	}
}

// runOnce runs the sequence once, returning the shortest unit of the limits
// it reached and whether it straddled one of its boundaries.
func runOnce(t *testing.T, peer, qf *rlsSide, calls []call, problems *[]string) (unit time.Duration, crossed bool) {
	t.Helper()
	for _, s := range []*rlsSide{peer, qf} {
		if err := s.redis.FlushAll(context.Background()).Err(); err != nil {
			t.Fatal(err)
		}
	}
	m := newModel()
	start := time.Now()
	for i, c := range calls {
		where := fmt.Sprintf("call %d %q", i+1, c.text)
		pr, perr := peer.ask(c)
		qr, qerr := qf.ask(c)
		if perr != nil {
			if qerr == nil {
				*problems = append(*problems, fmt.Sprintf("%s: the peer refuses it (%v), admission answers %v", where, perr, brief(qr)))
			}
			continue
		}
		for _, st := range pr.GetStatuses() {
			if l := st.GetCurrentLimit(); l != nil {
				if u := unitDuration(l.Unit); unit == 0 || u < unit {
					unit = u
				}
			}
		}
		if len(pr.GetStatuses()) != len(c.descs) {
			*problems = append(*problems, fmt.Sprintf("%s: the peer answers %d statuses", where, len(pr.GetStatuses())))
			continue
		}
		if want := m.envoyAnswer(c, pr); !sameAnswer(want, pr) {
			*problems = append(*problems, fmt.Sprintf("%s: the model of envoy predicts %v, the peer answers %v", where, brief(want), brief(pr)))
		}
		if p := headerProblem(pr); p != "" {
			*problems = append(*problems, fmt.Sprintf("%s: the peer's %s", where, p))
		}
		if c.overrides() {
			if status.Code(qerr) != codes.InvalidArgument {
				*problems = append(*problems, fmt.Sprintf("%s: admission answers %v (%v), want InvalidArgument: it does not take a descriptor's own limit", where, brief(qr), qerr))
			}
			continue
		}
		if qerr != nil {
			*problems = append(*problems, fmt.Sprintf("%s: admission fails (%v), the peer answers %v", where, qerr, brief(pr)))
			continue
		}
		if want := m.qfAnswer(c, pr); !sameAnswer(want, qr) {
			*problems = append(*problems, fmt.Sprintf("%s: admission answers %v, want %v (the peer: %v)", where, brief(qr), brief(want), brief(pr)))
		}
		if d := resetSkew(pr, qr); d != "" {
			*problems = append(*problems, where+": "+d)
		}
		if p := headerProblem(qr); p != "" {
			*problems = append(*problems, fmt.Sprintf("%s: admission's %s", where, p))
		}
	}
	if unit == 0 {
		return 0, false
	}
	// Windows are aligned to the Unix epoch, as envoy's (a month is 30
	// days, a year 365).
	div := int64(unit / time.Second)
	return unit, start.Unix()/div != time.Now().Unix()/div
}

// waitWindow sleeps until just after the next boundary of unit's windows
// (at most a second: longer units only straddle by bad luck, and wait for
// a second too).
func waitWindow(unit time.Duration) {
	unit = min(unit, time.Second)
	now := time.Now()
	time.Sleep(now.Truncate(unit).Add(unit).Sub(now) + 5*time.Millisecond)
}

func unitDuration(u rlpb.RateLimitResponse_RateLimit_Unit) time.Duration {
	switch u {
	case rlpb.RateLimitResponse_RateLimit_SECOND:
		return time.Second
	case rlpb.RateLimitResponse_RateLimit_MINUTE:
		return time.Minute
	case rlpb.RateLimitResponse_RateLimit_HOUR:
		return time.Hour
	case rlpb.RateLimitResponse_RateLimit_DAY:
		return 24 * time.Hour
	case rlpb.RateLimitResponse_RateLimit_WEEK:
		return 7 * 24 * time.Hour
	case rlpb.RateLimitResponse_RateLimit_MONTH:
		return 30 * 24 * time.Hour
	case rlpb.RateLimitResponse_RateLimit_YEAR:
		return 365 * 24 * time.Hour
	}
	return 0
}

// sameAnswer compares the overall code and, per descriptor, the code, the
// limit (requests per unit, unit, name) and the remaining count.
func sameAnswer(a, b *rlpb.RateLimitResponse) bool {
	if a.GetOverallCode() != b.GetOverallCode() || len(a.GetStatuses()) != len(b.GetStatuses()) {
		return false
	}
	for i, x := range a.GetStatuses() {
		y := b.GetStatuses()[i]
		lx, ly := x.GetCurrentLimit(), y.GetCurrentLimit()
		if x.GetCode() != y.GetCode() || x.GetLimitRemaining() != y.GetLimitRemaining() || (lx == nil) != (ly == nil) {
			return false
		}
		if lx != nil && (lx.RequestsPerUnit != ly.RequestsPerUnit || lx.Unit != ly.Unit || lx.Name != ly.Name) {
			return false
		}
	}
	return true
}

// headerProblem reports rate-limit headers of r other than those its
// statuses call for (wantHeaders), the reset within a second.
func headerProblem(r *rlpb.RateLimitResponse) string {
	want, wok := wantHeaders(r)
	got, gok := gotHeaders(r)
	d := want.reset - got.reset
	if wok != gok || got.limit != want.limit || got.remaining != want.remaining || d > time.Second || d < -time.Second {
		return fmt.Sprintf("headers are %+v (%v), want %+v (%v)", got, gok, want, wok)
	}
	return ""
}

// resetSkew reports a duration_until_reset of admission's more than a
// second from the peer's (both count to the end of the same window).
func resetSkew(peer, qf *rlpb.RateLimitResponse) string {
	for i, p := range peer.GetStatuses() {
		if i >= len(qf.GetStatuses()) || p.GetDurationUntilReset() == nil {
			continue
		}
		q := qf.GetStatuses()[i].GetDurationUntilReset()
		d := p.GetDurationUntilReset().AsDuration() - q.AsDuration()
		if q == nil || d > time.Second || d < -time.Second {
			return fmt.Sprintf("descriptor %d resets in %v at admission, %v at the peer", i, q.AsDuration(), p.GetDurationUntilReset().AsDuration())
		}
	}
	return ""
}

// brief writes an answer as OVERALL[code:remaining/limit per unit(name)...].
func brief(r *rlpb.RateLimitResponse) string {
	if r == nil {
		return "nil"
	}
	var b strings.Builder
	b.WriteString(r.GetOverallCode().String() + "[")
	for i, st := range r.GetStatuses() {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s:%d", st.GetCode(), st.GetLimitRemaining())
		if l := st.GetCurrentLimit(); l != nil {
			fmt.Fprintf(&b, "/%d per %s", l.RequestsPerUnit, strings.ToLower(l.Unit.String()))
			if l.Name != "" {
				fmt.Fprintf(&b, "(%s)", l.Name)
			}
		}
	}
	return b.String() + "]"
}

// exampleSequences exercise the peer's examples/ratelimit/config: domains
// rl and mongo_cps.
var exampleSequences = []sequence{
	{"one descriptor to its limit and past it", []string{
		"rl foo=a", "rl foo=a", "rl foo=a", "rl foo=a"}},
	{"a nested limit and its parent are separate counters", []string{
		"rl foo=a,bar=b", "rl foo=a", "rl foo=a,bar=b", "rl foo=a,bar=b", "rl foo=a,bar=b", "rl foo=a"}},
	{"request hits_addend", []string{
		"rl h2 unspec=x", "rl unspec=x", "rl h2 unspec=y", "rl h3 unspec=z"}},
	{"descriptor hits_addend, zero included", []string{
		"rl foo=a#2", "rl foo=a#0", "rl foo=a#1", "rl foo=a#0"}},
	{"a value beats the key alone", []string{
		"rl foo=a,baz=not-so-shady", "rl foo=a,baz=not-so-shady", "rl foo=a,baz=not-so-shady", "rl foo=a,baz=not-so-shady"}},
	{"the key alone: a per-second limit", []string{
		"rl foo=a,baz=any", "rl foo=a,baz=any", "rl foo=a,baz=other"}},
	{"shadow mode is never over", []string{
		"rl foo=a,baz=shady", "rl foo=a,baz=shady", "rl foo=a,baz=shady", "rl foo=a,baz=shady", "rl h5 foo=a,baz=shady"}},
	{"unlimited and no limit at all", []string{
		"rl qux=a", "rl h9 qux=a", "rl foo=a,bay=b", "rl nothing=here", "rl foo=a,bar=b,deeper=c", "nodomain foo=a"}},
	{"a limit of zero is over for any hit, not for a check of none", []string{
		"rl foo=a,bar=banned", "rl foo=a,bar=banned foo=a", "rl foo=a", "rl foo=a,bar=banned#0", "rl foo=a,bar=banned#0 foo=a",
		"rl foo=a,bar=banned foo=a,bar=banned#0", "rl foo=a,bar=banned#0 foo=a,bar=banned"}},
	{"replaces drops the named limit", []string{
		"rl foo=a,bar=bkthomps", "rl foo=a,bar=bkthomps category=account", "rl category=account foo=a,bar=bkthomps",
		"rl foo=a,bar=bkthomps", "rl source_cluster=proxy,destination_cluster=bkthomps foo=b,bar=bkthomps"}},
	{"replaces a zero limit", []string{
		"rl source_cluster=proxy,destination_cluster=override foo=a,bar=banned", "rl foo=a,bar=banned"}},
	{"a named limit replaced by a sibling descriptor", []string{
		"rl source_cluster=proxy,destination_cluster=fake category=account", "rl source_cluster=proxy,destination_cluster=fake",
		"rl source_cluster=proxy,destination_cluster=fake", "rl source_cluster=proxy,destination_cluster=fake"}},
	{"two descriptors, one over", []string{
		"rl source_cluster=proxy,destination_cluster=mock foo=a", "rl source_cluster=proxy,destination_cluster=mock foo=a",
		"rl foo=a", "rl foo=a"}},
	{"the same descriptor twice in a request counts twice", []string{
		"rl unspec=x unspec=x", "rl unspec=x", "rl h2 foo=a,bar=b foo=a,bar=b"}},
	{"a repeat with other hits sees its earlier occurrence's, allowed or denied", []string{
		"rl foo=b#2 unspec=x foo=b#0 unspec=x#2", "rl unspec=x#0 unspec=y#3 unspec=x unspec=x", "rl unspec=z#0 foo=c foo=c#0"}},
	{"a hits_addend past the limit", []string{
		"rl h3 foo=a", "rl foo=a"}},
	{"mongo_cps per second", []string{
		"mongo_cps h499 database=users", "mongo_cps database=users", "mongo_cps database=users", "mongo_cps h500 database=default",
		"mongo_cps database=other"}},
	{"a descriptor's own limit: envoy applies it, admission refuses the request", []string{
		"rl foo=a@1/minute", "rl foo=a@1/minute unspec=x", "rl foo=a", "rl unspec=x", "rl h3 nothing=here@2/hour"}},
	{"invalid requests", []string{
		`"" foo=a`}},
}

// configSet is configuration files both servers load, the sequences that
// exercise them and the descriptors random sequences draw from.
type configSet struct {
	name   string
	files  []string // paths in the pinned module's source, or testdata/
	domain string   // of the random sequences
	seqs   []sequence
	random []string
	// tenantKeys and userKeys are admission's QF_ENVOY_TENANT_KEYS and
	// QF_ENVOY_USER_KEYS: none puts each domain on one subject, some
	// spread a request's descriptors over several (one charge each,
	// still all or nothing).
	tenantKeys, userKeys []string
}

var configSets = []configSet{
	{
		name: "examples", files: []string{"examples/ratelimit/config/config.yaml", "examples/ratelimit/config/example.yaml"},
		domain: "rl", seqs: exampleSequences, random: exampleRandom,
	},
	{
		name: "examples, tenant and user keys", files: []string{"examples/ratelimit/config/config.yaml", "examples/ratelimit/config/example.yaml"},
		domain: "rl", seqs: exampleSequences, random: exampleRandom,
		tenantKeys: []string{"foo", "source_cluster", "category"}, userKeys: []string{"bar", "baz", "destination_cluster"},
	},
	{
		name: "the peer's tests", files: []string{"test/config/wildcard.yaml", "test/integration/runtime/current/ratelimit/config/basic.yaml",
			"test/integration/runtime/current/ratelimit/config/another.yaml"},
		domain: "test-domain", seqs: peerTestSequences,
		random: []string{"wild=foo", "wild=foo1", "wild=foobar", "wild=fo", "noWild=foo", "noWild=foo1", "noVal=x", "noVal=",
			"midWild=bar*b", "midWild=barxb", "nestedWild=val1,wild=goo", "nestedWild=val1,wild=goo1", "nestedWild=val1", "nestedWild=val2,wild=goo1"},
	},
	{
		name: "the peer's basic config", files: []string{"test/config/basic_config.yaml"},
		domain: "test-domain", seqs: basicSequences,
		random: []string{"key1=value1,subkey1=x", "key1=value1,subkey1=subvalue1", "key1=value1", "key2=x", "key2=value2", "key2=value3",
			"key3=a", "key4=a", "key5=value5", "key5=value5,subkey5=subvalue5", "key5=other", "key6=x", "key7=x"},
	},
	{
		name: "the peer's shadow-mode config", files: []string{"test/config/shadowmode_config.yaml"},
		domain: "test-domain", seqs: shadowSequences,
		random: []string{"key1=value1,subkey1=x", "key1=value1,subkey1=subvalue1", "key2=x", "key2=y", "key2=value2"},
	},
	{
		name: "testdata/envoy", files: []string{"testdata/envoy/overlap.yaml"},
		domain: "overlap", seqs: overlapSequences,
		random: []string{"path=/api/v1/x", "path=/api/v2", "path=/api", "path=/other", "path=/api/v1/x,method=GET",
			"path=/api/v1/x,method=POST", "path=/api/v1/y,method=GET", "user=alice", "user=bob", "user=alice,tier=free", "user=bob,tier=free"},
	},
}

// exampleRandom are the descriptors random sequences draw from in
// examples/ratelimit/config: every kind of match and a few misses.
var exampleRandom = []string{
	"foo=a", "foo=b", "foo=a,bar=b", "foo=b,bar=c", "foo=a,bar=bkthomps", "foo=a,bar=banned",
	"foo=a,baz=not-so-shady", "foo=a,baz=shady", "foo=a,bay=x", "unspec=x", "unspec=y", "qux=z",
	"category=account", "source_cluster=proxy,destination_cluster=bkthomps", "source_cluster=proxy,destination_cluster=mock",
	"source_cluster=proxy,destination_cluster=override", "source_cluster=proxy,destination_cluster=fake",
	"nothing=here", "foo=a,bar=b,deeper=c",
}

// peerTestSequences exercise configurations of the peer's own tests:
// wildcards (a value ending in *, matched as a prefix; a * elsewhere is
// literal) and per-hour and per-day limits.
var peerTestSequences = []sequence{
	{"a wildcard value matches by prefix, one counter per value", []string{
		"test-domain h19 wild=foo1", "test-domain wild=foo1", "test-domain wild=foo1", "test-domain h20 wild=foo", "test-domain wild=foo2"}},
	{"a wildcard that does not match, a literal star", []string{
		"test-domain h30 wild=fo", "test-domain h20 midWild=bar*b", "test-domain midWild=bar*b", "test-domain h50 midWild=barxb"}},
	{"a nested wildcard", []string{
		"test-domain h20 nestedWild=val1,wild=goo", "test-domain nestedWild=val1,wild=goo", "test-domain nestedWild=val1,wild=goose",
		"test-domain h9 nestedWild=val1"}},
	{"an exact value beside a key alone", []string{
		"test-domain h20 noWild=foo", "test-domain noWild=foo", "test-domain h3 noWild=foo1", "test-domain h20 noVal=", "test-domain noVal="}},
	{"per second, hour and day", []string{
		"basic h50 key1=a", "basic key1=a", "another h10 key3=b", "another key3=b", "another h19 key4=c", "another key4=c",
		"another key4=c", "basic one_per_minute=x one_per_minute=y"}},
}

// basicSequences exercise the peer's test/config/basic_config.yaml: a
// value beside its key's default, a value without a limit (an exemption
// from the key's), a named limit, nested values, unlimited.
var basicSequences = []sequence{
	{"a key's default, a value's own limit and an exempt value", []string{
		"test-domain h20 key2=other", "test-domain key2=other", "test-domain h30 key2=value2", "test-domain key2=value2",
		"test-domain h100 key2=value3", "test-domain key2=value3 key2=other"}},
	{"a repeat after the descriptor that denied sees its hits", []string{
		"test-domain key4=a#2 key4=a", "test-domain key4=a key4=a", "test-domain key4=a#0 key4=a", "test-domain key4=a key4=a#0"}},
	{"hour and day limits, named and nested", []string{
		"test-domain key3=a", "test-domain key3=a", "test-domain key4=a key4=b", "test-domain key4=a",
		"test-domain h15 key5=value5", "test-domain key5=value5,subkey5=subvalue5", "test-domain key5=value5", "test-domain key6=x"}},
	{"per second under a value without a limit", []string{
		"test-domain h5 key1=value1,subkey1=x", "test-domain key1=value1,subkey1=x", "test-domain h10 key1=value1,subkey1=subvalue1",
		"test-domain key1=value1"}},
}

// shadowSequences exercise the peer's test/config/shadowmode_config.yaml:
// limits in shadow mode beside others, nested and at the top.
var shadowSequences = []sequence{
	{"a nested limit in shadow mode beside its key's own", []string{
		"test-domain h5 key1=value1,subkey1=x", "test-domain key1=value1,subkey1=x", "test-domain h10 key1=value1,subkey1=subvalue1",
		"test-domain key1=value1,subkey1=subvalue1"}},
	{"a shadow limit over does not deny the others", []string{
		"test-domain h20 key2=x", "test-domain key2=x key2=value2", "test-domain h29 key2=value2", "test-domain key2=value2 key2=y",
		"test-domain key2=y"}},
}

// overlapSequences exercise testdata/envoy/overlap.yaml: wildcards that
// overlap (the first in file order wins), a wildcard's nested limits,
// unlimited and shadow mode under a wildcard, and replaces across them.
var overlapSequences = []sequence{
	{"the first of two matching wildcards wins", []string{
		"overlap path=/api/v1/x", "overlap path=/api/v1/x", "overlap path=/api/v1/x", "overlap path=/api/v2", "overlap h4 path=/api"}},
	{"nested under a wildcard", []string{
		"overlap path=/api/v1/x,method=GET", "overlap path=/api/v1/x,method=GET", "overlap path=/api/v1/x,method=POST",
		"overlap path=/api/v1/x,method=POST", "overlap path=/other,method=GET"}},
	{"a repeat after another descriptor denied", []string{
		"overlap user=bob", "overlap user=alice user=alice", "overlap user=bob user=alice user=bob", "overlap user=bob user=bob"}},
	{"replaces across descriptors", []string{
		"overlap user=alice user=bob,tier=free", "overlap user=alice,tier=free user=bob", "overlap user=alice", "overlap user=alice",
		"overlap user=bob,tier=free path=/api/v1/x"}},
}

// TestShouldRateLimitMatchesEnvoy loads each configSet into
// envoyproxy/ratelimit and into admission (QF_ENVOY_RATELIMIT_CONFIG, a
// directory of the same files), and sends both the same sequences of
// ShouldRateLimit calls: the hand-written ones, then random ones drawn from
// the set's descriptors. Each answer is checked against a model of the two
// (envoymodel_test.go): admission may differ from the peer only where
// README.md lists a difference.
func TestShouldRateLimitMatchesEnvoy(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs envoyproxy/ratelimit")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, err := envoypeer.Source(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("random sequences from seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for _, set := range configSets {
		t.Run(set.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, f := range set.files {
				from := filepath.Join(src, f)
				if strings.HasPrefix(f, "testdata/") {
					from = f
				}
				b, err := os.ReadFile(from)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			peer, qf := startPeer(t, dir), startAdmission(t, dir, set.tenantKeys, set.userKeys)
			for _, seq := range set.seqs {
				runSequence(t, peer, qf, seq)
			}
			for i := range 30 {
				runSequence(t, peer, qf, randomSequence(r, set.domain, set.random, fmt.Sprintf("random %d (seed %d)", i, seed)))
			}
		})
	}
}

// randomSequence is 2 to 8 calls of 1 to 3 descriptors drawn from descs,
// now and then a repeat of the call's previous one, and now and then with
// a hits_addend of the request or of a descriptor (0 included).
func randomSequence(r *rand.Rand, domain string, descs []string, name string) sequence {
	seq := sequence{name: name}
	for range 2 + r.IntN(7) {
		c := domain
		if r.IntN(4) == 0 {
			c += fmt.Sprintf(" h%d", r.IntN(4))
		}
		d := ""
		for range 1 + r.IntN(3) {
			if d == "" || r.IntN(3) != 0 {
				d = descs[r.IntN(len(descs))]
			}
			c += " " + d
			if r.IntN(5) == 0 {
				c += fmt.Sprintf("#%d", r.IntN(3))
			}
		}
		seq.calls = append(seq.calls, c)
	}
	return seq
}
