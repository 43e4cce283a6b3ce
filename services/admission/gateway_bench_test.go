package main

import (
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/code"
)

// BenchmarkGatewayCheck is one gateway check by each protocol, on the
// real Redis and NATS behind the same stack: /v1/authz over HTTP/1.1
// (keep-alive) and ext_authz's Check over gRPC (one HTTP/2 connection, as
// Envoy's cluster), from b.RunParallel's goroutines; every check is a new
// request of one of 10k users, allowed. Run both in one go so they share
// the machine's state: go test -run '^$' -bench GatewayCheck -count 6.
func BenchmarkGatewayCheck(b *testing.B) {
	s := newStack(b, `
default_plan: p
plans:
  p:
    rates: [{name: rps, kind: token_bucket, rate: 1000000, per: 1s, burst: 1000000}]
    quotas: [{name: tokens, kind: rolling, window: 24h, limit: 1000000000}]
`, []string{"gw-token"})
	grpcClient := extAuthzClient(b, s)
	httpClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	var n atomic.Int64 // request ids and users
	next := func() (user, id string) {
		i := n.Add(1)
		return fmt.Sprintf("u-%d", i%10000), fmt.Sprintf("bench-%d", i)
	}
	b.Run("http_authz", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				user, id := next()
				req, _ := http.NewRequest("GET", s.srv.URL+"/v1/authz/api/x", nil)
				req.Header.Set("Authorization", "Bearer gw-token")
				req.Header.Set("X-Quota-Tenant", s.tenant)
				req.Header.Set("X-Quota-User", user)
				req.Header.Set("X-Quota-Estimated-Tokens", "10")
				req.Header.Set("X-Request-Id", id)
				resp, err := httpClient.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("/v1/authz = %d", resp.StatusCode)
				}
			}
		})
	})
	b.Run("grpc_ext_authz", func(b *testing.B) {
		b.ReportAllocs()
		ctx := bearer("gw-token")
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				user, id := next()
				resp, err := grpcClient.Check(ctx, checkRequest("/api/x", "", "X-Quota-Tenant", s.tenant, "X-Quota-User", user,
					"X-Quota-Estimated-Tokens", "10", "X-Request-Id", id))
				if err != nil || resp.GetStatus().GetCode() != int32(code.Code_OK) {
					b.Fatalf("Check = %v, %v", resp, err)
				}
			}
		})
	})
}
