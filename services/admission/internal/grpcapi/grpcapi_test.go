package grpcapi

import (
	"context"
	"errors"
	"testing"
	"time"

	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"quotaflow/internal/obs"
	"quotaflow/services/admission/internal/auth"
)

// service is a ShouldRateLimit that reports its caller's tenant grant and
// can be held in flight.
type service struct {
	rlspb.UnimplementedRateLimitServiceServer
	arrived chan struct{}
	release chan struct{}
}

func (s *service) ShouldRateLimit(ctx context.Context, req *rlspb.RateLimitRequest) (*rlspb.RateLimitResponse, error) {
	if s.arrived != nil {
		close(s.arrived)
		select {
		case <-s.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if ok, _ := Principal(ctx).For(req.GetDomain()); !ok {
		return nil, status.Error(codes.PermissionDenied, "tenant")
	}
	return &rlspb.RateLimitResponse{OverallCode: rlspb.RateLimitResponse_OK}, nil
}

func start(t *testing.T, svc *service, ready *obs.Readiness) (*Server, *grpc.ClientConn) {
	t.Helper()
	tokens, err := auth.New(auth.Options{Tokens: []string{"gw#gateway", "acme@acme#gateway", "rep#report"}})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{Auth: tokens, Ready: ready})
	if err != nil {
		t.Fatal(err)
	}
	s.Register(&rlspb.RateLimitService_ServiceDesc, svc, auth.Gateway)
	if err := s.Listen("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	conn, err := grpc.NewClient(s.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return s, conn
}

func withToken(header string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", header)
}

// A registered method needs a token with its role; the handler sees the
// caller's grants; health needs no token.
func TestAuth(t *testing.T) {
	_, conn := start(t, &service{}, nil)
	c := rlspb.NewRateLimitServiceClient(conn)
	for _, tc := range []struct {
		name   string
		ctx    context.Context
		tenant string
		want   codes.Code
	}{
		{"none", context.Background(), "acme", codes.Unauthenticated},
		{"unknown", withToken("Bearer nope"), "acme", codes.Unauthenticated},
		{"two headers", metadata.AppendToOutgoingContext(withToken("Bearer gw"), "authorization", "Bearer gw"), "acme", codes.Unauthenticated},
		{"role missing", withToken("Bearer rep"), "acme", codes.PermissionDenied},
		{"bound, own tenant", withToken("bearer acme"), "acme", codes.OK},
		{"bound, other tenant", withToken("Bearer acme"), "other", codes.PermissionDenied},
		{"unbound", withToken("Bearer gw"), "other", codes.OK},
	} {
		_, err := c.ShouldRateLimit(tc.ctx, &rlspb.RateLimitRequest{Domain: tc.tenant})
		if got := status.Code(err); got != tc.want {
			t.Errorf("%s: ShouldRateLimit = %v, want %v", tc.name, err, tc.want)
		}
	}
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health without readiness = %v, %v; want SERVING", h, err)
	}
}

// Health follows the readiness: NOT_SERVING until ready and once draining.
func TestHealthFollowsReadiness(t *testing.T) {
	ready := obs.NewReadiness("streams")
	_, conn := start(t, &service{}, ready)
	check := func() healthpb.HealthCheckResponse_ServingStatus {
		h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return h.GetStatus()
	}
	if got := check(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("before ready = %v, want NOT_SERVING", got)
	}
	ready.Ready("streams")
	if got := check(); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("ready = %v, want SERVING", got)
	}
	ready.Drain()
	if got := check(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("draining = %v, want NOT_SERVING", got)
	}
}

// Stop lets a call in flight finish; past its deadline it cancels it.
func TestStop(t *testing.T) {
	for _, expire := range []bool{false, true} {
		svc := &service{arrived: make(chan struct{}), release: make(chan struct{})}
		s, conn := start(t, svc, nil)
		res := make(chan error, 1)
		go func() {
			_, err := rlspb.NewRateLimitServiceClient(conn).ShouldRateLimit(withToken("Bearer gw"), &rlspb.RateLimitRequest{Domain: "x"})
			res <- err
		}()
		<-svc.arrived
		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan error, 1)
		go func() { stopped <- s.Stop(ctx) }()
		if expire {
			cancel()
			if err := <-stopped; !errors.Is(err, context.Canceled) {
				t.Errorf("Stop past its deadline = %v, want context.Canceled", err)
			}
			if err := <-res; status.Code(err) == codes.OK {
				t.Errorf("call in flight past Stop's deadline = %v, want it ended", err)
			}
			continue
		}
		select {
		case err := <-stopped:
			t.Fatalf("Stop returned %v with a call in flight", err)
		case <-time.After(50 * time.Millisecond): // not a timing assertion: Stop must still be waiting
		}
		close(svc.release)
		if err := <-res; err != nil {
			t.Errorf("call in flight during Stop = %v, want it finished", err)
		}
		if err := <-stopped; err != nil {
			t.Errorf("Stop = %v", err)
		}
		cancel()
	}
}
