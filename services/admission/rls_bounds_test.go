package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/services/admission/internal/rls"
)

// A request at each of rls's bounds is answered; one past any bound is
// InvalidArgument naming the field, and charges nothing: every refused
// request also carries a limited descriptor, whose counter is untouched
// afterwards.
func TestShouldRateLimitBounds(t *testing.T) {
	r := startRLS(t, "rlsbounds", nil)
	charged := func() *rlv3.RateLimitDescriptor { return desc("tenant", "tb", "user", "bo") }
	// free is a descriptor no limit matches: accepted requests count nothing.
	free := func(kv ...string) *rlv3.RateLimitDescriptor { return desc(append([]string{"nolimit", "x"}, kv...)...) }
	many := func(n int, f func(i int) *rlv3.RateLimitDescriptor) []*rlv3.RateLimitDescriptor {
		ds := make([]*rlv3.RateLimitDescriptor, n)
		for i := range ds {
			ds[i] = f(i)
		}
		return ds
	}
	entries := func(n int) *rlv3.RateLimitDescriptor {
		d := &rlv3.RateLimitDescriptor{}
		for i := range n {
			d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: fmt.Sprintf("k%d", i), Value: "v"})
		}
		return d
	}
	withHits := func(d *rlv3.RateLimitDescriptor, n uint64) *rlv3.RateLimitDescriptor {
		d.HitsAddend = wrapperspb.UInt64(n)
		return d
	}
	long := strings.Repeat("é", rls.MaxIDBytes/2) // MaxIDBytes bytes of UTF-8
	over := long + "x"
	for _, c := range []struct {
		name   string
		domain string // "": r.domain
		ds     []*rlv3.RateLimitDescriptor
		want   string // "": accepted; else InvalidArgument with this in the message
	}{
		{"max descriptors", "", many(rls.MaxDescriptors, func(int) *rlv3.RateLimitDescriptor { return free() }), ""},
		{"too many descriptors", "", many(rls.MaxDescriptors+1, func(i int) *rlv3.RateLimitDescriptor {
			if i == 0 {
				return charged()
			}
			return free()
		}), fmt.Sprintf("descriptors: %d, more than %d", rls.MaxDescriptors+1, rls.MaxDescriptors)},
		{"max entries", "", []*rlv3.RateLimitDescriptor{entries(rls.MaxEntries)}, ""},
		{"too many entries", "", []*rlv3.RateLimitDescriptor{charged(), entries(rls.MaxEntries + 1)},
			fmt.Sprintf("descriptors[1].entries: %d, more than %d", rls.MaxEntries+1, rls.MaxEntries)},
		{"no entries", "", []*rlv3.RateLimitDescriptor{charged(), {}}, "descriptors[1].entries: empty"},
		{"longest domain", long, []*rlv3.RateLimitDescriptor{free()}, ""},
		{"domain too long", over, []*rlv3.RateLimitDescriptor{charged()}, "domain: longer than"},
		{"longest key", "", []*rlv3.RateLimitDescriptor{free(long, "v")}, ""},
		{"key too long", "", []*rlv3.RateLimitDescriptor{charged(), free(over, "v")}, "descriptors[1].entries[1].key: longer than"},
		{"empty key", "", []*rlv3.RateLimitDescriptor{charged(), free("", "v")}, "descriptors[1].entries[1].key: empty"},
		{"longest value", "", []*rlv3.RateLimitDescriptor{free("k", long)}, ""},
		{"empty value", "", []*rlv3.RateLimitDescriptor{free("k", "")}, ""},
		{"value too long", "", []*rlv3.RateLimitDescriptor{charged(), free("k", over)}, "descriptors[1].entries[1].value: longer than"},
		{"value with DEL", "", []*rlv3.RateLimitDescriptor{charged(), free("k", "a\x7fb")}, "descriptors[1].entries[1].value: contains a control character"},
		{"value with a C1 control", "", []*rlv3.RateLimitDescriptor{charged(), free("k", "a\u0085b")}, "descriptors[1].entries[1].value: contains a control character"},
		{"tenant with a C1 control", "", []*rlv3.RateLimitDescriptor{charged(), desc("tenant", "a\u009fb", "user", "bo")}, "descriptors[1].entries[0].value: contains a control character"},
		{"longest tenant", "", []*rlv3.RateLimitDescriptor{desc("tenant", long, "user", "bo")}, ""},
		{"tenant too long", "", []*rlv3.RateLimitDescriptor{charged(), desc("tenant", over, "user", "bo")}, "descriptors[1].entries[0].value: longer than"},
		{"max hits_addend", "", []*rlv3.RateLimitDescriptor{withHits(free(), limits.MaxCost)}, ""},
		{"hits_addend too large", "", []*rlv3.RateLimitDescriptor{charged(), withHits(free(), limits.MaxCost+1)},
			fmt.Sprintf("descriptors[1].hits_addend: more than %d", int64(limits.MaxCost))},
		{"limit override", "", []*rlv3.RateLimitDescriptor{charged(), func() *rlv3.RateLimitDescriptor {
			d := free()
			d.Limit = &rlv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 100, Unit: 1}
			return d
		}()}, "descriptors[1].limit: limit overrides are not supported"},
	} {
		domain := c.domain
		if domain == "" {
			domain = r.domain
		}
		resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: domain, Descriptors: c.ds})
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: ShouldRateLimit = %v, want OK", c.name, err)
		case c.want == "" && (resp.GetOverallCode() != rlspb.RateLimitResponse_OK || len(resp.GetStatuses()) != len(c.ds)):
			t.Errorf("%s: ShouldRateLimit = %v, want OK with %d statuses", c.name, codesOf(resp), len(c.ds))
		case c.want != "" && (status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), c.want)):
			t.Errorf("%s: ShouldRateLimit = %v, want InvalidArgument %q", c.name, err, c.want)
		}
	}
	// Invalid UTF-8 never reaches validate: protobuf-go refuses it on both
	// sides, so a raw client sends it; the server's decoding refuses it as
	// the caller's fault (grpcapi turns grpc-go's Internal into
	// InvalidArgument).
	req, err := proto.Marshal(&rlspb.RateLimitRequest{Domain: r.domain, Descriptors: []*rlv3.RateLimitDescriptor{charged(), free("k", "a~b")}})
	if err != nil {
		t.Fatal(err)
	}
	raw := bytes.Replace(req, []byte("a~b"), []byte("a\xffb"), 1)
	var resp []byte
	err = r.conn.Invoke(bearer(gatewayToken), "/"+rlspb.RateLimitService_ServiceDesc.ServiceName+"/ShouldRateLimit", raw, &resp, grpc.ForceCodec(rawCodec{}))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "invalid UTF-8") {
		t.Errorf("value not UTF-8: ShouldRateLimit = %v, want InvalidArgument naming invalid UTF-8", err)
	}
	// Limit 3: the refused requests left the counter at zero.
	if got := codesOf(r.call(t, 0, charged())); got != "OK OK/2" {
		t.Errorf("first accepted call after the refused ones = %s, want OK OK/2", got)
	}
}

// A refill (is_negative_hits) is InvalidArgument and gives nothing back,
// whatever its hits_addend, and charges nothing for the request's other
// descriptors; is_negative_hits false is an ordinary charge.
func TestShouldRateLimitRefusesRefill(t *testing.T) {
	r := startRLS(t, "rlsrefill", nil)
	alice := func() *rlv3.RateLimitDescriptor { return desc("tenant", "tr", "user", "alice") }
	bob := func() *rlv3.RateLimitDescriptor { return desc("tenant", "tr", "user", "bob") }
	if got := codesOf(r.call(t, 0, alice())); got != "OK OK/2" {
		t.Fatalf("first call = %s, want OK OK/2", got)
	}
	refill := func(hits *wrapperspb.UInt64Value) *rlv3.RateLimitDescriptor {
		d := alice()
		d.HitsAddend, d.IsNegativeHits = hits, true
		return d
	}
	for _, c := range []struct {
		name string
		ds   []*rlv3.RateLimitDescriptor
		want string
	}{
		{"refill of 2", []*rlv3.RateLimitDescriptor{refill(wrapperspb.UInt64(2))}, "descriptors[0].is_negative_hits: refills are not supported"},
		{"refill of the request's hits", []*rlv3.RateLimitDescriptor{refill(nil)}, "descriptors[0].is_negative_hits"},
		{"refill beside a charge", []*rlv3.RateLimitDescriptor{bob(), refill(wrapperspb.UInt64(1))}, "descriptors[1].is_negative_hits"},
	} {
		_, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: c.ds, HitsAddend: 2})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), c.want) {
			t.Errorf("%s: ShouldRateLimit = %v, want InvalidArgument %q", c.name, err, c.want)
		}
	}
	// Alice's counter kept its one hit, bob's has none.
	if got := codesOf(r.call(t, 0, alice(), bob())); got != "OK OK/1 OK/2" {
		t.Errorf("alice and bob after the refused refills = %s, want OK OK/1 OK/2", got)
	}
	notRefill := alice()
	notRefill.HitsAddend, notRefill.IsNegativeHits = wrapperspb.UInt64(1), false
	if got := codesOf(r.call(t, 0, notRefill)); got != "OK OK/0" {
		t.Errorf("is_negative_hits false, hits_addend 1 = %s, want OK OK/0 (charged)", got)
	}
}

// rawCodec sends and receives messages as they are: bytes a proto codec
// would refuse to marshal.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error)      { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error { *v.(*[]byte) = data; return nil }
func (rawCodec) Name() string                       { return "proto" }

// With Redis down past QF_FAILOPEN_AFTER, every call is allowed unchecked:
// OK with the whole limit remaining, well past the limit of 3, and no call
// fails. (Before that the calls are decided locally:
// TestShouldRateLimitRedisDown.)
func TestShouldRateLimitFailOpen(t *testing.T) {
	srv := redistest.Start(t)
	r := startRLS(t, "rlsfailopen", func(c *Config) {
		c.RedisURL = "redis://" + srv.Addr + "/0"
		c.RedisTimeout = 200 * time.Millisecond
		c.FailOpenAfter = time.Nanosecond // as soon as the breaker opens
	})
	d := desc("tenant", "t5", "user", "eve")
	srv.Stop()
	e2e.EventuallyLast(t, "calls allowed unchecked", func() (bool, string) {
		got := codesOf(r.call(t, 0, d))
		return got == "OK OK/3", got
	})
	for i := range 10 {
		if got := codesOf(r.call(t, 0, d)); got != "OK OK/3" {
			t.Fatalf("call %d failing open = %s, want OK OK/3", i+1, got)
		}
	}
}
