// Package extauthz is Envoy's external authorization over gRPC,
// envoy.service.auth.v3.Authorization/Check, on admission's gRPC server
// (package grpcapi; docs/design.md §4): the check /v1/authz makes, for
// Envoy's ext_authz filter with a grpc_service.
//
// A CheckRequest is read as /v1/authz reads an HTTP request (the same
// code, package httpapi): identity and estimate from the original
// request's X-Quota-* and X-Request-Id headers, which the gateway's
// configuration sets after removing the client's; the endpoint from its
// path; the client's address from the source address Envoy reports. The
// answer carries what /v1/authz's would:
//
//   - an allow is status OK with the rate-limit headers (RateLimit,
//     RateLimit-Policy, X-RateLimit-*) in OkHttpResponse's
//     response_headers_to_add, for Envoy to add to the client's answer;
//   - a denial is a DeniedHttpResponse with status 429, Retry-After when
//     waiting cures it, the rate-limit headers, X-Quota-Denied and the
//     problem body, under status RESOURCE_EXHAUSTED;
//   - a request that cannot be checked (a missing or invalid identity,
//     endpoint, address or count) is the same 429 without Retry-After,
//     under INVALID_ARGUMENT with "<field>: <what is wrong>";
//   - a tenant or plan the caller's token may not act for is a 403
//     DeniedHttpResponse under PERMISSION_DENIED.
//
// None of these is an RPC error, so Envoy's failure_mode_allow never lets
// such a request through; the caller's own token is checked by grpcapi,
// which refuses the call itself (Unauthenticated, PermissionDenied).
package extauthz

import (
	"context"
	"maps"
	"net/http"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	authv3 "github.com/envoyproxy/go-control-plane/envoy/service/auth/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/genproto/googleapis/rpc/code"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"quotaflow/internal/auth"
	"quotaflow/services/admission/internal/grpcapi"
	"quotaflow/services/admission/internal/httpapi"
)

// Checker makes the check: *httpapi.Handler.
type Checker interface {
	Check(ctx context.Context, p auth.Principal, c httpapi.GatewayCheck) httpapi.CheckAnswer
}

// Server implements authv3.AuthorizationServer. Register it on the gRPC
// server with the gateway role:
//
//	srv.Register(&authv3.Authorization_ServiceDesc, extauthz.New(api), auth.Gateway)
type Server struct {
	authv3.UnimplementedAuthorizationServer
	api Checker
}

// New returns the service, checking with api.
func New(api Checker) *Server { return &Server{api: api} }

// Check answers one ext_authz check (see the package documentation).
func (s *Server) Check(ctx context.Context, req *authv3.CheckRequest) (*authv3.CheckResponse, error) {
	attrs := req.GetAttributes()
	h := attrs.GetRequest().GetHttp()
	if h == nil {
		return nil, status.Error(codes.InvalidArgument, "attributes.request.http: required (ext_authz of an HTTP request)")
	}
	ans := s.api.Check(ctx, grpcapi.Principal(ctx), httpapi.GatewayCheck{
		Header: headerOf(h),
		Path:   h.GetPath(),
		IP:     attrs.GetSource().GetAddress().GetSocketAddress().GetAddress(),
	})
	switch {
	case ans.Status == http.StatusOK:
		return &authv3.CheckResponse{
			Status: &rpcstatus.Status{Code: int32(code.Code_OK)},
			HttpResponse: &authv3.CheckResponse_OkResponse{OkResponse: &authv3.OkHttpResponse{
				ResponseHeadersToAdd: headers(ans.Header, rateLimitHeaders),
			}},
		}, nil
	case ans.Status == 499:
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	st := &rpcstatus.Status{Code: int32(code.Code_RESOURCE_EXHAUSTED), Message: "quota exceeded"}
	switch {
	case ans.Invalid != "":
		st = &rpcstatus.Status{Code: int32(code.Code_INVALID_ARGUMENT), Message: ans.Invalid}
	case ans.Status == http.StatusForbidden:
		st = &rpcstatus.Status{Code: int32(code.Code_PERMISSION_DENIED), Message: "authorization: this token does not allow this request"}
	case ans.Status != http.StatusTooManyRequests:
		st = &rpcstatus.Status{Code: int32(code.Code_UNKNOWN), Message: http.StatusText(ans.Status)}
	}
	return &authv3.CheckResponse{
		Status: st,
		HttpResponse: &authv3.CheckResponse_DeniedResponse{DeniedResponse: &authv3.DeniedHttpResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(ans.Status)},
			Headers: headers(ans.Header, nil),
			Body:    string(ans.Body),
		}},
	}, nil
}

// headerOf looks a header up in a CheckRequest: in headers (lower-case
// names, repeated headers joined by commas), or in header_map when Envoy
// sends raw headers (encode_raw_headers), the first of a repeated one.
func headerOf(h *authv3.AttributeContext_HttpRequest) func(string) string {
	m, raw := h.GetHeaders(), h.GetHeaderMap().GetHeaders()
	return func(name string) string {
		name = lower(name)
		if v, ok := m[name]; ok {
			return v
		}
		for _, hv := range raw {
			if hv.GetKey() == name {
				if v := hv.GetValue(); v != "" {
					return v
				}
				return string(hv.GetRawValue())
			}
		}
		return ""
	}
}

// lowerNames are the headers httpapi reads and the rate-limit headers of
// an answer, in lower case, so that a check does not lower them again.
var lowerNames = func() map[string]string {
	m := map[string]string{}
	for _, n := range append([]string{
		"X-Quota-Tenant", "X-Quota-User", "X-Quota-Plan", "X-Quota-Model", "X-Request-Id",
		"X-Quota-Estimated-Tokens", "X-Quota-Input-Tokens", "X-Quota-Max-Output-Tokens",
	}, rateLimitHeaders...) {
		m[n] = strings.ToLower(n)
	}
	return m
}()

func lower(name string) string {
	if l, ok := lowerNames[name]; ok {
		return l
	}
	return strings.ToLower(name)
}

// rateLimitHeaders are the headers an allow passes to the client.
var rateLimitHeaders = []string{"Ratelimit", "Ratelimit-Policy", "X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset"}

// headers converts the answer's headers (only those named in only, when
// it is not nil; else all, sorted), each replacing any header of the same
// name. The messages of all the headers take three allocations.
func headers(h http.Header, only []string) []*corev3.HeaderValueOption {
	if only == nil {
		only = slices.Sorted(maps.Keys(h))
	}
	n := 0
	for _, k := range only {
		n += len(h[k])
	}
	if n == 0 {
		return nil
	}
	out := make([]*corev3.HeaderValueOption, 0, n)
	opts, values := make([]corev3.HeaderValueOption, n), make([]corev3.HeaderValue, n)
	for _, k := range only {
		for _, v := range h[k] {
			i := len(out)
			values[i].Key, values[i].Value = lower(k), v
			opts[i].Header, opts[i].AppendAction = &values[i], corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
			out = append(out, &opts[i])
		}
	}
	return out
}
