package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	authv3 "github.com/envoyproxy/go-control-plane/envoy/service/auth/v3"
	"google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"quotaflow/internal/auth"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
	"quotaflow/services/admission/internal/extauthz"
	"quotaflow/services/admission/internal/grpcapi"
)

// ext_authz over gRPC: a real gRPC client calls Authorization/Check on
// admission's gRPC server (package grpcapi, its token check included),
// with the stack of e2e_test.go behind it (real Redis and NATS).

// extAuthzClient serves Check for s on a gRPC server of its own and returns
// a client of it.
func extAuthzClient(t testing.TB, s *stack) authv3.AuthorizationClient {
	t.Helper()
	srv, err := grpcapi.New(grpcapi.Options{Auth: s.auth})
	if err != nil {
		t.Fatal(err)
	}
	srv.Register(&authv3.Authorization_ServiceDesc, extauthz.New(s.api), auth.Gateway)
	if err := srv.Listen("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := srv.Stop(ctx); err != nil {
			t.Errorf("grpcapi.Server.Stop = %v", err)
		}
	})
	conn, err := grpc.NewClient(srv.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return authv3.NewAuthorizationClient(conn)
}

// checkRequest is what Envoy sends for a request to path from ip, with
// headers (name, value, ...; Envoy sends them in lower case).
func checkRequest(path, ip string, headers ...string) *authv3.CheckRequest {
	h := map[string]string{}
	for i := 0; i+1 < len(headers); i += 2 {
		h[strings.ToLower(headers[i])] = headers[i+1]
	}
	return &authv3.CheckRequest{Attributes: &authv3.AttributeContext{
		Source: &authv3.AttributeContext_Peer{Address: &corev3.Address{Address: &corev3.Address_SocketAddress{
			SocketAddress: &corev3.SocketAddress{Address: ip, PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: 40000}},
		}}},
		Request: &authv3.AttributeContext_Request{Http: &authv3.AttributeContext_HttpRequest{
			Method: "POST", Path: path, Headers: h,
		}},
	}}
}

// responseHeaders maps a response's headers by name; a name twice fails.
func responseHeaders(t *testing.T, hs []*corev3.HeaderValueOption) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, h := range hs {
		k := h.GetHeader().GetKey()
		if _, dup := m[k]; dup {
			t.Errorf("header %s twice", k)
		}
		if h.GetAppendAction() != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
			t.Errorf("header %s appends (%v): a gateway's own header of the name would stay", k, h.GetAppendAction())
		}
		m[k] = h.GetHeader().GetValue()
	}
	return m
}

// TestExtAuthzCheck: three allows with the rate-limit headers for the
// client, then a 429 with Retry-After; the reserved events carry what the
// check said (headers, path, source address); a reused request id is a
// denial.
func TestExtAuthzCheck(t *testing.T) {
	s := newStack(t, gatewayPolicy, []string{"gw-token"})
	c := extAuthzClient(t, s)
	ctx := bearer("gw-token")
	check := func(id string) *authv3.CheckResponse {
		t.Helper()
		resp, err := c.Check(ctx, checkRequest("/api/v1/gen%65rate?stream=1", "::ffff:203.0.113.7",
			"X-Quota-Tenant", s.tenant, "X-Quota-User", "alice", "X-Quota-Estimated-Tokens", "250", "X-Request-Id", id,
			"Authorization", "Bearer the-client's-own", "X-Original-URI", "/not/read/over/grpc"))
		if err != nil {
			t.Fatalf("Check(%s) = %v", id, err)
		}
		return resp
	}
	for i := range 3 {
		resp := check(fmt.Sprintf("rid-%d", i))
		ok := resp.GetOkResponse()
		if resp.GetStatus().GetCode() != int32(code.Code_OK) || ok == nil {
			t.Fatalf("check %d = %v, want OK", i, resp)
		}
		h := responseHeaders(t, ok.GetResponseHeadersToAdd())
		if !strings.HasPrefix(h["ratelimit"], `"user:allowance";r=`+fmt.Sprint(2-i)+";t=") ||
			!strings.Contains(h["ratelimit-policy"], `"user:allowance";q=3`) || h["x-ratelimit-limit"] != "3" ||
			h["x-ratelimit-remaining"] != fmt.Sprint(2-i) || h["x-ratelimit-reset"] == "" || len(h) != 5 {
			t.Errorf("check %d: response headers %v", i, h)
		}
		if len(ok.GetHeaders()) != 0 || len(ok.GetHeadersToRemove()) != 0 {
			t.Errorf("check %d changes the upstream request: %v", i, ok)
		}
	}

	resp := check("rid-3")
	d := resp.GetDeniedResponse()
	if resp.GetStatus().GetCode() != int32(code.Code_RESOURCE_EXHAUSTED) || d == nil || d.GetStatus().GetCode() != 429 {
		t.Fatalf("4th check = %v, want RESOURCE_EXHAUSTED with a 429", resp)
	}
	h := responseHeaders(t, d.GetHeaders())
	if h["retry-after"] == "" || h["retry-after"] == "0" || !strings.HasPrefix(h["ratelimit"], `"user:allowance";r=0;t=`) ||
		h["x-ratelimit-remaining"] != "0" || h["x-quota-denied"] != "1" || h["content-type"] != "application/problem+json" {
		t.Errorf("denial headers %v", h)
	}
	if !strings.Contains(d.GetBody(), `"type":"https://iana.org/assignments/http-problem-types#quota-exceeded"`) ||
		!strings.Contains(d.GetBody(), `"violated-policies":["user:allowance"]`) {
		t.Errorf("denial body %s", d.GetBody())
	}
	// A request id a reservation holds is a denial, never a replayed allow.
	resp = check("rid-0")
	if d := resp.GetDeniedResponse(); d == nil || !strings.Contains(d.GetBody(), `"reason":"request_id_reused"`) {
		t.Errorf("a reused request id = %v, want a denial for request_id_reused", resp)
	}

	s.close() // flushes the outbox
	var got []string
	for _, ev := range natstest.StoredEvents(t, s.js, s.cfg.Stream) {
		r, ok := ev.Data.(events.Reserved)
		if !ok {
			continue
		}
		got = append(got, r.RequestID)
		if r.Tenant != s.tenant || r.User != "alice" || r.Endpoint != "/api/v1/generate" || r.IP != "203.0.113.7" ||
			r.EstimatedTokens != 250 || r.Plan != "three" {
			t.Errorf("reserved %+v, want alice's on /api/v1/generate from 203.0.113.7 for 250 tokens", r)
		}
	}
	if strings.Join(got, ",") != "rid-0,rid-1,rid-2" {
		t.Errorf("reserved events of %v, want rid-0,rid-1,rid-2", got)
	}
}

// TestExtAuthzRefusals: a check that cannot be made is a denial with a
// clear status, never an RPC error Envoy's failure_mode_allow would let
// through; a caller without a good token is refused the call; a token
// bound to a tenant checks for that tenant only.
func TestExtAuthzRefusals(t *testing.T) {
	s := newStack(t, contractPolicy, []string{"gw-token", "scoped-token@TENANT", "report-token#report"})
	c := extAuthzClient(t, s)
	id := []string{"X-Quota-Tenant", s.tenant, "X-Quota-User", "u"}
	for _, tc := range []struct {
		name, token, path, ip string
		headers               []string
		code                  code.Code
		http                  int32
		detail                string
	}{
		{"allowed", "gw-token", "/api/x", "192.0.2.1", id, code.Code_OK, 0, ""},
		{"no tenant", "gw-token", "/api/x", "192.0.2.1", []string{"X-Quota-User", "u"}, code.Code_INVALID_ARGUMENT, 429, "X-Quota-Tenant: required"},
		{"no user", "gw-token", "/api/x", "192.0.2.1", []string{"X-Quota-Tenant", s.tenant}, code.Code_INVALID_ARGUMENT, 429, "X-Quota-User: required"},
		{"control character", "gw-token", "/api/x", "192.0.2.1", []string{"X-Quota-Tenant", s.tenant, "X-Quota-User", "u\x01"},
			code.Code_INVALID_ARGUMENT, 429, "X-Quota-User: contains a control character"},
		{"bad estimate", "gw-token", "/api/x", "192.0.2.1", append([]string{"X-Quota-Estimated-Tokens", "lots"}, id...),
			code.Code_INVALID_ARGUMENT, 429, "X-Quota-Estimated-Tokens: must be a whole number from 0 to 1000000000000"},
		{"unknown plan", "gw-token", "/api/x", "192.0.2.1", append([]string{"X-Quota-Plan", "gold"}, id...),
			code.Code_INVALID_ARGUMENT, 429, `plan: "gold" is not a plan of the policy`},
		{"no path", "gw-token", "", "192.0.2.1", id, code.Code_INVALID_ARGUMENT, 429, "path: required"},
		{"escaped control character in the path", "gw-token", "/api/%01", "192.0.2.1", id,
			code.Code_INVALID_ARGUMENT, 429, "path: contains a control character"},
		{"bad source address", "gw-token", "/api/x", "pipe", id, code.Code_INVALID_ARGUMENT, 429, "source address: not an IP address"},
		{"no source address", "gw-token", "/api/x", "", id, code.Code_OK, 0, ""},
		{"scoped token, own tenant", "scoped-token", "/api/x", "192.0.2.1", id, code.Code_OK, 0, ""},
		{"scoped token, another tenant", "scoped-token", "/api/x", "192.0.2.1", []string{"X-Quota-Tenant", s.tenant + "-other", "X-Quota-User", "u"},
			code.Code_PERMISSION_DENIED, 403, ""},
		{"scoped token, a plan not granted", "scoped-token", "/api/x", "192.0.2.1", append([]string{"X-Quota-Plan", "paid"}, id...),
			code.Code_PERMISSION_DENIED, 403, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := c.Check(bearer(tc.token), checkRequest(tc.path, tc.ip, tc.headers...))
			if err != nil {
				t.Fatalf("Check = %v, want an answer", err)
			}
			if got := resp.GetStatus(); got.GetCode() != int32(tc.code) || tc.detail != "" && got.GetMessage() != tc.detail {
				t.Errorf("status = %v %q, want %v %q", code.Code(got.GetCode()), got.GetMessage(), tc.code, tc.detail)
			}
			if tc.code == code.Code_OK {
				return
			}
			d := resp.GetDeniedResponse()
			if int32(d.GetStatus().GetCode()) != tc.http {
				t.Errorf("denied response %v, want HTTP %d", d, tc.http)
			}
			h := responseHeaders(t, d.GetHeaders())
			if h["retry-after"] != "" {
				t.Errorf("Retry-After %q on a request that never fits", h["retry-after"])
			}
			if tc.detail != "" && (h["x-quota-denied"] != "1" || !strings.Contains(d.GetBody(), `"reason":"invalid_request"`)) {
				t.Errorf("invalid request's denial: headers %v body %s", h, d.GetBody())
			}
		})
	}

	// Envoy's raw headers (encode_raw_headers: header_map, values as
	// bytes) are read as its header map is.
	for _, tc := range []struct {
		tenant string
		want   code.Code
	}{
		{s.tenant, code.Code_OK},
		{s.tenant + "-other", code.Code_PERMISSION_DENIED},
	} {
		req := checkRequest("/api/x", "192.0.2.1")
		req.Attributes.Request.Http.HeaderMap = &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: "x-quota-tenant", RawValue: []byte(tc.tenant)}, {Key: "x-quota-user", RawValue: []byte("u")},
		}}
		if resp, err := c.Check(bearer("scoped-token"), req); err != nil || resp.GetStatus().GetCode() != int32(tc.want) {
			t.Errorf("raw headers of tenant %s: Check = %v, %v; want %v", tc.tenant, resp, err, tc.want)
		}
	}

	// The caller's own token: refused by the gRPC server, before Check.
	for _, tc := range []struct {
		ctx  context.Context
		want codes.Code
	}{
		{context.Background(), codes.Unauthenticated},
		{bearer("wrong"), codes.Unauthenticated},
		{bearer("report-token"), codes.PermissionDenied},
	} {
		if _, err := c.Check(tc.ctx, checkRequest("/api/x", "192.0.2.1", id...)); status.Code(err) != tc.want {
			t.Errorf("Check with metadata %v = %v, want %v", tc.ctx, err, tc.want)
		}
	}
	// Not an HTTP request's check: an RPC error, since there is no HTTP
	// answer to give.
	if _, err := c.Check(bearer("gw-token"), &authv3.CheckRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Check without attributes.request.http = %v, want InvalidArgument", err)
	}
}

// TestExtAuthzExactUnderConcurrency: N concurrent checks against a limit
// of L requests allow exactly L, and Redis holds exactly L requests' worth
// of tokens.
func TestExtAuthzExactUnderConcurrency(t *testing.T) {
	const limit, n, workers, cost = 20, 90, 12, 7
	s := newStack(t, fmt.Sprintf(`
default_plan: p
plans:
  p:
    rates: [{name: allowance, kind: token_bucket, rate: 0, per: 24h, burst: %d}]
    quotas: [{name: tokens, kind: rolling, window: 24h, limit: 1000000}]
`, limit), []string{"gw-token"})
	c := extAuthzClient(t, s)
	ctx := bearer("gw-token")
	var (
		wg              sync.WaitGroup
		mu              sync.Mutex
		allowed, denied int
		failures        []string
		next            = make(chan int)
	)
	for range workers {
		wg.Go(func() {
			for i := range next {
				resp, err := c.Check(ctx, checkRequest("/api/x", "192.0.2.1", "X-Quota-Tenant", s.tenant, "X-Quota-User", "u",
					"X-Quota-Estimated-Tokens", fmt.Sprint(cost), "X-Request-Id", fmt.Sprintf("c-%d", i)))
				mu.Lock()
				switch {
				case err != nil:
					failures = append(failures, err.Error())
				case resp.GetStatus().GetCode() == int32(code.Code_OK):
					allowed++
				case resp.GetDeniedResponse().GetStatus().GetCode() == 429:
					denied++
				default:
					failures = append(failures, resp.String())
				}
				mu.Unlock()
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if allowed != limit || denied != n-limit || len(failures) != 0 {
		t.Fatalf("%d allowed, %d denied, failures %v; want %d and %d", allowed, denied, failures, limit, n-limit)
	}
	a := s.call("GET", "/v1/usage?tenant="+s.tenant+"&user=u", "", "Authorization", "Bearer gw-token")
	used := map[string]any{}
	if ls, ok := a.body["limits"].([]any); ok {
		for _, l := range ls {
			if l, ok := l.(map[string]any); ok {
				used[fmt.Sprint(l["name"])] = l["used"]
			}
		}
	}
	if a.code != 200 || used["tokens"] != float64(limit*cost) || used["allowance"] != float64(limit) {
		t.Errorf("usage = %d %v, want %d tokens and %d requests used", a.code, a.body, limit*cost, limit)
	}
}

// TestExtAuthzOnGRPCAddr: run serves Check on QF_GRPC_ADDR beside
// ShouldRateLimit, with the tokens of QF_API_TOKENS.
func TestExtAuthzOnGRPCAddr(t *testing.T) {
	r := startRLS(t, "extauthz", nil)
	tenant := "acme-" + r.domain
	cleanupTenant(t, redistest.Shared(t), tenant)
	c := authv3.NewAuthorizationClient(r.conn)
	for _, tc := range []struct {
		tenant string
		want   code.Code
	}{
		{tenant, code.Code_OK},
		{tenant + "-other", code.Code_PERMISSION_DENIED}, // acmeToken is bound to its tenant
	} {
		resp, err := c.Check(bearer(acmeToken), checkRequest("/api/x", "192.0.2.1", "X-Quota-Tenant", tc.tenant, "X-Quota-User", "u"))
		if err != nil || resp.GetStatus().GetCode() != int32(tc.want) {
			t.Errorf("Check for tenant %s = %v, %v; want %v", tc.tenant, resp, err, tc.want)
		}
	}
	if _, err := c.Check(context.Background(), checkRequest("/api/x", "192.0.2.1", "X-Quota-Tenant", tenant, "X-Quota-User", "u")); status.Code(err) != codes.Unauthenticated {
		t.Errorf("Check without a token = %v, want Unauthenticated", err)
	}
}
