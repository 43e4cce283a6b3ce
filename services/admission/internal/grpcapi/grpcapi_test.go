package grpcapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/auth"
	"quotaflow/internal/obs"
)

// service is a ShouldRateLimit that reports its caller's tenant grant and
// can be held in flight.
type service struct {
	rlspb.UnimplementedRateLimitServiceServer
	arrived chan struct{}
	release chan struct{}
	calls   atomic.Int32
}

func (s *service) ShouldRateLimit(ctx context.Context, req *rlspb.RateLimitRequest) (*rlspb.RateLimitResponse, error) {
	s.calls.Add(1)
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

// start serves svc (a RateLimitServiceServer) for a test and connects to it.
func start(t *testing.T, svc any, ready *obs.Readiness) (*Server, *grpc.ClientConn) {
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

// A request message the server cannot read is the caller's fault,
// InvalidArgument naming what is wrong, and never reaches the handler; a
// message over MaxMessageBytes stays ResourceExhausted. The bytes are a
// BytesValue's: field 1, the request's domain, not UTF-8.
func TestUnreadableRequest(t *testing.T) {
	svc := &service{}
	_, conn := start(t, svc, nil)
	method := "/" + rlspb.RateLimitService_ServiceDesc.ServiceName + "/ShouldRateLimit"
	for _, c := range []struct {
		name string
		msg  []byte
		want codes.Code
		text string
	}{
		{"not UTF-8", []byte("a\xffb"), codes.InvalidArgument, "invalid UTF-8"},
		{"too large", bytes.Repeat([]byte("a"), MaxMessageBytes+1), codes.ResourceExhausted, "larger than max"},
	} {
		err := conn.Invoke(withToken("Bearer gw"), method, wrapperspb.Bytes(c.msg), &rlspb.RateLimitResponse{})
		if status.Code(err) != c.want || !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: ShouldRateLimit = %v, want %v naming %q", c.name, err, c.want, c.text)
		}
	}
	if n := svc.calls.Load(); n != 0 {
		t.Errorf("handler calls = %d, want 0", n)
	}
	// The service still answers a readable request.
	if _, err := rlspb.NewRateLimitServiceClient(conn).ShouldRateLimit(withToken("Bearer gw"), &rlspb.RateLimitRequest{Domain: "x"}); err != nil {
		t.Errorf("ShouldRateLimit after them = %v, want OK", err)
	}
}

// decoding is a service that decodes its requests itself, into the
// domain "acme" whatever they hold, except those that name "skip".
type decoding struct{ *service }

func (decoding) DecodeRequest(b []byte, msg any) bool {
	if bytes.Contains(b, []byte("skip")) {
		return false
	}
	msg.(*rlspb.RateLimitRequest).Domain = "acme"
	return true
}

// A service that is a Decoder decodes its methods' requests; the ones it
// leaves go to protobuf, whose refusal stays InvalidArgument.
func TestDecoder(t *testing.T) {
	_, conn := start(t, decoding{&service{}}, nil)
	method := "/" + rlspb.RateLimitService_ServiceDesc.ServiceName + "/ShouldRateLimit"
	for _, c := range []struct {
		name string
		msg  proto.Message
		want codes.Code
	}{
		{"decoded as acme's", &rlspb.RateLimitRequest{Domain: "other"}, codes.OK},
		{"left to protobuf", &rlspb.RateLimitRequest{Domain: "skip"}, codes.PermissionDenied},
		{"left to protobuf, not UTF-8", wrapperspb.Bytes([]byte("skip\xff")), codes.InvalidArgument},
	} {
		err := conn.Invoke(withToken("Bearer acme"), method, c.msg, &rlspb.RateLimitResponse{})
		if status.Code(err) != c.want {
			t.Errorf("%s: ShouldRateLimit = %v, want %v", c.name, err, c.want)
		}
	}
}

// encoder is a service that encodes its responses itself, as over the
// limit whatever they hold, and leaves other messages to protobuf.
type encoder struct{ *service }

func (encoder) EncodeResponse(msg any) ([]byte, bool) {
	if _, ok := msg.(*rlspb.RateLimitResponse); !ok {
		return nil, false
	}
	b, err := proto.Marshal(&rlspb.RateLimitResponse{OverallCode: rlspb.RateLimitResponse_OVER_LIMIT})
	return b, err == nil
}

// A service that is an Encoder encodes its methods' responses; the
// messages it leaves (the health service's) go to protobuf.
func TestEncoder(t *testing.T) {
	_, conn := start(t, encoder{&service{}}, nil)
	resp, err := rlspb.NewRateLimitServiceClient(conn).ShouldRateLimit(withToken("Bearer gw"), &rlspb.RateLimitRequest{Domain: "x"})
	if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OVER_LIMIT {
		t.Errorf("ShouldRateLimit = %v, %v; want the encoder's OVER_LIMIT", resp, err)
	}
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health = %v, %v; want SERVING, encoded by protobuf", h, err)
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

// Metadata over MaxHeaderBytes never reaches the interceptor: a grpc-go
// client refuses to send it (the server announced the bound), and a hostile
// client that sends it anyway, without a token, has its stream reset. The
// connection's settings announce the stream bound too.
func TestHeaderBounds(t *testing.T) {
	svc := &service{}
	s, conn := start(t, svc, nil)
	c := rlspb.NewRateLimitServiceClient(conn)
	pad := func(n int) context.Context {
		return metadata.AppendToOutgoingContext(withToken("Bearer gw"), "x-pad", strings.Repeat("a", n))
	}
	if _, err := c.ShouldRateLimit(pad(1<<10), &rlspb.RateLimitRequest{Domain: "x"}); err != nil {
		t.Fatalf("ShouldRateLimit with 1 KiB of metadata = %v, want OK", err)
	}
	if _, err := c.ShouldRateLimit(pad(MaxHeaderBytes), &rlspb.RateLimitRequest{Domain: "x"}); status.Code(err) == codes.OK {
		t.Errorf("ShouldRateLimit with %d bytes of metadata = OK, want an error", MaxHeaderBytes)
	}
	if n := svc.calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1 (the oversized call must not reach it)", n)
	}

	// Just over the bound in one frame: the stream is reset. Far over it,
	// in CONTINUATION frames: the connection is closed.
	for _, c := range []struct {
		pad  int
		want string
	}{{20 << 10, "RST_STREAM"}, {64 << 10, "closed"}} {
		a := rawCall(t, s.Addr(), c.pad)
		for id, want := range map[http2.SettingID]uint32{
			http2.SettingMaxHeaderListSize:    MaxHeaderBytes,
			http2.SettingMaxConcurrentStreams: MaxConcurrentStreams,
		} {
			if v, ok := a.settings[id]; !ok || v != want {
				t.Errorf("server setting %v = %d (sent: %v), want %d", id, v, ok, want)
			}
		}
		if a.answer != c.want {
			t.Errorf("raw call with %d KiB of metadata: the server answered %s, want %s", c.pad>>10, a.answer, c.want)
		}
	}
	if n := svc.calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1", n)
	}
}

// rawAnswer is what a server sent to rawCall: its settings, how it answered
// the call ("HEADERS": it took the call, "RST_STREAM": it reset the stream,
// "closed": it closed the connection) and the PINGs it sent of its own
// before answering rawCall's PING, sent once the call was answered.
type rawAnswer struct {
	settings map[http2.SettingID]uint32
	answer   string
	pings    int
}

// rawCall sends one ShouldRateLimit call without a token and with pad bytes
// of metadata over HTTP/2 frames of its own, as a client that ignores the
// server's settings would (fields of 1 KiB).
func rawCall(t *testing.T, addr string, pad int) rawAnswer {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// A guard against a hung test, not a timing assertion.
	nc.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(nc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(nc, nc)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range []hpack.HeaderField{
		{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"},
		{Name: ":path", Value: "/" + rlspb.RateLimitService_ServiceDesc.ServiceName + "/ShouldRateLimit"},
		{Name: ":authority", Value: addr}, {Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"},
	} {
		if err := enc.WriteField(f); err != nil {
			t.Fatal(err)
		}
	}
	// Fields of 1 KiB: one field longer than the bound is an HPACK error
	// that closes the whole connection.
	for i := range pad >> 10 {
		if err := enc.WriteField(hpack.HeaderField{Name: fmt.Sprintf("x-pad-%d", i), Value: strings.Repeat("a", 1<<10)}); err != nil {
			t.Fatal(err)
		}
	}
	// Frames of at most 16 KiB, the default SETTINGS_MAX_FRAME_SIZE.
	const frame = 16 << 10
	b := block.Bytes()
	first := b[:min(frame, len(b))]
	b = b[len(first):]
	// Write errors are ignored: a server that closes the connection early
	// breaks the pipe, and reading tells.
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: first, EndHeaders: len(b) == 0})
	for len(b) > 0 {
		n := min(frame, len(b))
		_ = fr.WriteContinuation(1, n == len(b), b[:n])
		b = b[n:]
	}
	// An empty request message ends the call.
	_ = fr.WriteData(1, true, []byte{0, 0, 0, 0, 0})
	a := rawAnswer{settings: map[http2.SettingID]uint32{}}
	// The server writes its frames in order, so its answer to our PING
	// follows every PING it queued before.
	barrier := [8]byte{'b', 'a', 'r', 'r', 'i', 'e', 'r'}
	for {
		f, err := fr.ReadFrame()
		var ne net.Error
		switch {
		case errors.As(err, &ne) && ne.Timeout():
			t.Fatalf("reading the server's frames: %v", err)
		case err != nil: // EOF or reset
			if a.answer == "" {
				a.answer = "closed"
			}
			return a
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			f.ForeachSetting(func(s http2.Setting) error { a.settings[s.ID] = s.Val; return nil })
			// A server that closed the connection breaks the pipe: the
			// next read tells.
			_ = fr.WriteSettingsAck()
		case *http2.PingFrame:
			if f.IsAck() && f.Data == barrier {
				return a
			}
			if !f.IsAck() {
				a.pings++
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == 1 && a.answer == "" {
				a.answer = "RST_STREAM"
				_ = fr.WritePing(false, barrier)
			}
		case *http2.HeadersFrame:
			if f.StreamID == 1 && a.answer == "" {
				a.answer = "HEADERS"
				_ = fr.WritePing(false, barrier)
			}
		}
	}
}

// The server's flow-control windows are fixed: a call's DATA draws no
// bandwidth-delay PING (grpc-go's default sends one, with a WINDOW_UPDATE,
// each round trip of every connection that receives data).
func TestFixedWindows(t *testing.T) {
	s, _ := start(t, &service{}, nil)
	a := rawCall(t, s.Addr(), 0)
	if a.answer != "HEADERS" {
		t.Fatalf("raw call: the server answered %s, want HEADERS", a.answer)
	}
	if v := a.settings[http2.SettingInitialWindowSize]; v != StreamWindow {
		t.Errorf("server's initial window = %d, want %d", v, StreamWindow)
	}
	if a.pings != 0 {
		t.Errorf("the server sent %d PINGs of its own during a call, want 0", a.pings)
	}
}

// A connection that never sends the HTTP/2 preface is closed after
// ConnectionTimeout (grpc-go's default waits 120 s).
func TestConnectionTimeout(t *testing.T) {
	s, _ := start(t, &service{}, nil)
	nc, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// Well past ConnectionTimeout, well before grpc-go's 120 s: a guard
	// telling the two apart, not a measurement.
	nc.SetReadDeadline(time.Now().Add(ConnectionTimeout + 30*time.Second))
	_, err = io.Copy(io.Discard, nc)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Errorf("a silent connection was still open %v after it was made, want it closed after %v", ConnectionTimeout+30*time.Second, ConnectionTimeout)
	}
}
