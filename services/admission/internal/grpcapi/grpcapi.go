// Package grpcapi is admission's gRPC server (QF_GRPC_ADDR, docs/design.md
// §4): one listener that the gRPC services of admission register on, the
// bearer-token authentication of every call (package auth, as on the HTTP
// API) and the standard health service.
//
// A service registers before Serve with the role its callers need:
//
//	srv.Register(&rlspb.RateLimitService_ServiceDesc, handler, auth.Gateway)
//
// Every call of a registered service then needs "authorization: Bearer
// <token>" metadata naming a token that holds the role for some tenant:
// codes.Unauthenticated without one, codes.PermissionDenied without the
// role. The handler finds the caller's principal, already acting in the
// role, with Principal(ctx), and checks the tenant it acts for with
// Principal.For, as the HTTP handlers do. grpc.health.v1.Health needs no
// token, as /healthz needs none: it answers SERVING while /readyz would
// answer 200.
//
// A registered method's request message that protobuf cannot read (a
// string field that is not UTF-8, a malformed field) is InvalidArgument
// naming the problem: the fault is the caller's, where grpc-go would
// answer Internal.
package grpcapi

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"quotaflow/internal/auth"
	"quotaflow/internal/obs"
)

// Bounds of a connection and its calls. Metadata is read before the
// interceptor authenticates a call, so these bound what a caller without a
// token can make the server hold: grpc-go's defaults are 16 MiB of metadata
// per call, unlimited concurrent streams, 120 s to send the HTTP/2 preface
// and no limit on pings.
const (
	// MaxMessageBytes is the largest request message accepted (64 KiB, as
	// the HTTP API's MaxBodyBytes): a ShouldRateLimit request is a few
	// hundred bytes.
	MaxMessageBytes = 64 << 10
	// MaxHeaderBytes bounds a call's metadata (HTTP/2 header list size, as
	// HPACK counts it): a bearer token and Envoy's headers are well under
	// 1 KiB. A larger header list resets the stream.
	MaxHeaderBytes = 16 << 10
	// MaxConcurrentStreams bounds the calls in flight on one connection;
	// past it, Envoy and grpc-go clients queue or open another connection.
	MaxConcurrentStreams = 256
	// ConnectionTimeout bounds the time a new connection has to send the
	// HTTP/2 preface and settings.
	ConnectionTimeout = 5 * time.Second
	// MaxConnectionIdle closes (GOAWAY) a connection without a call for
	// this long; clients reconnect when they next call.
	MaxConnectionIdle = 5 * time.Minute
	// KeepaliveTime and KeepaliveTimeout: the server pings a connection
	// quiet for KeepaliveTime and closes it without an answer within
	// KeepaliveTimeout, so dead peers do not hold streams.
	KeepaliveTime    = time.Minute
	KeepaliveTimeout = 20 * time.Second
	// MinPingInterval is the shortest interval between a client's pings
	// (grpc-go clients' own minimum); faster pings close the connection.
	MinPingInterval = 10 * time.Second
	// StreamWorkers are the goroutines that serve calls, each keeping the
	// stack it has grown: without them every call starts a goroutine whose
	// stack grows (copies) on every call, a few percent of a call's CPU. A
	// call that finds every worker busy gets a goroutine of its own, as
	// without workers; 64 cover bench-rls's concurrency.
	StreamWorkers = 64
	// StreamWindow and ConnWindow are fixed HTTP/2 flow-control windows.
	// grpc-go's default measures the bandwidth-delay product instead, with
	// a PING and a WINDOW_UPDATE each round trip on every connection that
	// receives data: frames, flushes and wake-ups that calls of a few
	// hundred bytes pay for and never need. A stream's window holds the
	// largest message. grpc-go refills a connection's window as data
	// arrives, not as it is read, so it bounds nothing held: a connection
	// can make the server hold MaxConcurrentStreams × MaxMessageBytes
	// (16 MiB) of unread requests, as with the default windows.
	StreamWindow = MaxMessageBytes
	ConnWindow   = 1 << 20
)

// Server is admission's gRPC server. Create it with New, Register the
// services, then Serve; Stop ends it. Register must not be called after
// Serve.
type Server struct {
	srv      *grpc.Server
	tokens   *auth.Auth
	log      *slog.Logger
	methods  map[string]method // by full method name; read-only once serving
	duration *prometheus.HistogramVec
	codec    *codec
	ln       net.Listener
	done     chan error
	once     sync.Once
}

// method is what the server knows of a registered method: the role its
// callers need and its duration series by code class.
type method struct {
	role     auth.Roles
	observer [3]prometheus.Observer // ok, client, server
}

// Options configure a Server.
type Options struct {
	// Auth checks the bearer tokens; nil accepts every call (no
	// authentication, as on the HTTP API).
	Auth *auth.Auth
	// Ready answers the health service; nil answers SERVING.
	Ready *obs.Readiness
	// Log receives the serving loop's errors; nil discards them.
	Log *slog.Logger
	// Registerer receives quotaflow_admission_grpc_request_duration_seconds;
	// nil registers nothing.
	Registerer prometheus.Registerer
}

// codeClasses are the code label's values: OK, a caller's fault
// (InvalidArgument, Unauthenticated, PermissionDenied, Canceled...) or the
// server's (Internal, Unavailable...).
var codeClasses = [3]string{"ok", "client", "server"}

func codeClass(c codes.Code) int {
	switch c {
	case codes.OK:
		return 0
	case codes.Internal, codes.Unavailable, codes.Unknown, codes.DataLoss, codes.Unimplemented, codes.DeadlineExceeded:
		return 2
	}
	return 1
}

// New returns a server with the health service registered.
func New(o Options) (*Server, error) {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{tokens: o.Auth, log: o.Log.With("component", "grpcapi"), methods: map[string]method{},
		codec: &codec{CodecV2: encoding.GetCodecV2(protocodec.Name)},
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "quotaflow_admission_grpc_request_duration_seconds",
			Help: "Time to answer a call of a registered gRPC method, by method and code class (ok, client, server).",
			// 50 µs to about 1.6 s, as the HTTP API's.
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16),
		}, []string{"method", "code"}),
	}
	if o.Registerer != nil {
		if err := o.Registerer.Register(s.duration); err != nil {
			return nil, fmt.Errorf("grpcapi: %w", err)
		}
	}
	s.srv = grpc.NewServer(
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		grpc.MaxHeaderListSize(MaxHeaderBytes),
		grpc.MaxConcurrentStreams(MaxConcurrentStreams),
		grpc.ConnectionTimeout(ConnectionTimeout),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: MaxConnectionIdle,
			Time: KeepaliveTime, Timeout: KeepaliveTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: MinPingInterval, PermitWithoutStream: true}),
		grpc.NumStreamWorkers(StreamWorkers),
		grpc.StaticStreamWindowSize(StreamWindow),
		grpc.StaticConnWindowSize(ConnWindow),
		grpc.ForceServerCodecV2(s.codec),
		grpc.ChainUnaryInterceptor(s.unary),
		grpc.ChainStreamInterceptor(s.stream),
	)
	healthpb.RegisterHealthServer(s.srv, health{ready: o.Ready})
	return s, nil
}

// Decoder is a service that reads its request messages from their wire
// form itself, more cheaply than protobuf's reflection. DecodeRequest
// decodes b into msg (a method's request message) as proto.Unmarshal
// would, or reports false, leaving msg untouched, for protobuf to decode
// it: a message it does not read, or one protobuf would refuse. It must not
// keep b, which the transport reuses.
type Decoder interface {
	DecodeRequest(b []byte, msg any) bool
}

// Encoder is a service that writes its response messages' wire form
// itself, more cheaply than protobuf's reflection. EncodeResponse returns
// msg's wire form as proto.Marshal would, or reports false for protobuf to
// encode it: a message it does not write. The codec asks it about every
// message the server sends.
type Encoder interface {
	EncodeResponse(msg any) ([]byte, bool)
}

// Register adds service sd, implemented by impl, whose every method needs
// role (see the package documentation). An impl that is a Decoder decodes
// its methods' requests; one that is an Encoder encodes its responses.
func (s *Server) Register(sd *grpc.ServiceDesc, impl any, role auth.Roles) {
	decoder, _ := impl.(Decoder)
	if e, ok := impl.(Encoder); ok {
		s.codec.encoders = append(s.codec.encoders, e)
	}
	names := make([]string, 0, len(sd.Methods)+len(sd.Streams))
	for _, m := range sd.Methods {
		names = append(names, m.MethodName)
	}
	for _, m := range sd.Streams {
		names = append(names, m.StreamName)
	}
	for _, n := range names {
		m := method{role: role}
		for i, c := range codeClasses {
			m.observer[i] = s.duration.WithLabelValues(n, c)
		}
		s.methods["/"+sd.ServiceName+"/"+n] = m
	}
	// A copy, so that the generated descriptor stays as generated.
	desc := *sd
	desc.Methods = slices.Clone(sd.Methods)
	for i, m := range desc.Methods {
		desc.Methods[i].Handler = func(srv any, ctx context.Context, dec func(any) error, in grpc.UnaryServerInterceptor) (any, error) {
			return m.Handler(srv, ctx, func(msg any) error {
				r := &request{msg: msg, dec: decoder}
				if err := dec(r); err != nil {
					return err
				}
				if r.err != nil {
					return status.Error(codes.InvalidArgument, "request message: "+r.err.Error())
				}
				return nil
			}, in)
		}
	}
	s.srv.RegisterService(&desc, impl)
}

// request is what a registered method decodes its request message into:
// the message, its service's Decoder (nil: none), and why protobuf could
// not read it.
type request struct {
	msg any
	dec Decoder
	err error
}

// codec is the proto codec, except that it decodes a request without
// failing and leaves the error in it: grpc-go would send Internal for a
// failure of its own before the handler could answer; and that the
// registered Encoders write the messages they know. encoders is read-only
// once serving.
type codec struct {
	encoding.CodecV2
	encoders []Encoder
}

func (c *codec) Marshal(v any) (mem.BufferSlice, error) {
	for _, e := range c.encoders {
		if b, ok := e.EncodeResponse(v); ok {
			return mem.BufferSlice{mem.SliceBuffer(b)}, nil
		}
	}
	return c.CodecV2.Marshal(v)
}

func (c *codec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*request); ok {
		if r.dec != nil && r.dec.DecodeRequest(contiguous(data), r.msg) {
			return nil
		}
		r.err = c.CodecV2.Unmarshal(data, r.msg)
		return nil
	}
	return c.CodecV2.Unmarshal(data, v)
}

// contiguous returns data's bytes in one slice: its one buffer's (a
// message of a few hundred bytes arrives in one), else a copy.
func contiguous(data mem.BufferSlice) []byte {
	if len(data) == 1 {
		return data[0].ReadOnlyData()
	}
	return data.Materialize()
}

// Listen binds addr and serves from a goroutine that Stop waits for, so a
// taken port fails start-up.
func (s *Server) Listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen grpc on %s: %w", addr, err)
	}
	s.ln, s.done = ln, make(chan error, 1)
	go func() {
		err := s.srv.Serve(ln)
		if err != nil {
			s.log.Error("grpc server stopped", "err", err)
		}
		s.done <- err
	}()
	return nil
}

// Addr is the address the server listens on (useful with ":0").
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Stop stops taking calls and waits for the calls in flight to finish, or
// until ctx ends: then it cancels them. It waits for the serving goroutine.
func (s *Server) Stop(ctx context.Context) error {
	var err error
	s.once.Do(func() {
		stopped := make(chan struct{})
		go func() {
			s.srv.GracefulStop()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-ctx.Done():
			s.srv.Stop()
			<-stopped
			err = fmt.Errorf("grpc calls still in flight: %w", ctx.Err())
		}
		if s.done != nil {
			if serr := <-s.done; err == nil {
				err = serr
			}
		}
	})
	return err
}

// principalKey is the context key of the caller's principal.
type principalKey struct{}

// principalContext carries the caller's principal: one allocation a call,
// where context.WithValue and the principal boxed in an interface take two.
type principalContext struct {
	context.Context
	p auth.Principal
}

func (c *principalContext) Value(key any) any {
	if key == (principalKey{}) {
		return c
	}
	return c.Context.Value(key)
}

// NewContext returns ctx carrying p for Principal: how the server hands a
// call's principal to its handler.
func NewContext(ctx context.Context, p auth.Principal) context.Context {
	return &principalContext{Context: ctx, p: p}
}

// Principal returns the principal of the call ctx belongs to, acting in the
// role its method needs. Outside a registered method it may do nothing.
func Principal(ctx context.Context) auth.Principal {
	if c, ok := ctx.Value(principalKey{}).(*principalContext); ok {
		return c.p
	}
	return auth.Principal{}
}

// errUnauthenticated and errForbidden are the answers of a refused call; one
// message per code, so that a caller learns nothing about what its token
// lacks.
var (
	errUnauthenticated = status.Error(codes.Unauthenticated, "authorization: missing or invalid bearer token")
	errForbidden       = status.Error(codes.PermissionDenied, "authorization: this token does not allow this request")
)

// authenticate returns ctx with the caller's principal acting in m's role,
// or the error that refuses the call.
func (s *Server) authenticate(ctx context.Context, m method) (context.Context, error) {
	role := m.role
	var header string
	// Not FromIncomingContext: it copies every header of the call.
	if v := metadata.ValueFromIncomingContext(ctx, "authorization"); len(v) == 1 {
		header = v[0]
	}
	p, ok := s.tokens.AuthenticateHeader(header)
	if !ok {
		return nil, errUnauthenticated
	}
	p = p.As(role)
	if !p.Allowed() {
		return nil, errForbidden
	}
	return NewContext(ctx, p), nil
}

func (s *Server) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	m, ok := s.methods[info.FullMethod]
	if !ok { // health
		return h(ctx, req)
	}
	start := time.Now()
	ctx, err := s.authenticate(ctx, m)
	var resp any
	if err == nil {
		resp, err = h(ctx, req)
	}
	m.observer[codeClass(status.Code(err))].Observe(time.Since(start).Seconds())
	return resp, err
}

func (s *Server) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	m, ok := s.methods[info.FullMethod]
	if !ok {
		return h(srv, ss)
	}
	start := time.Now()
	ctx, err := s.authenticate(ss.Context(), m)
	if err == nil {
		err = h(srv, &serverStream{ServerStream: ss, ctx: ctx})
	}
	m.observer[codeClass(status.Code(err))].Observe(time.Since(start).Seconds())
	return err
}

// serverStream carries the principal's context into a stream handler.
type serverStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *serverStream) Context() context.Context { return s.ctx }

// health is grpc.health.v1.Health over the service's readiness: SERVING
// when /readyz would answer 200, NOT_SERVING before start-up completes and
// while draining. Every service name gets the whole service's status.
type health struct {
	healthpb.UnimplementedHealthServer
	ready *obs.Readiness
}

func (h health) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	st := healthpb.HealthCheckResponse_SERVING
	if h.ready != nil {
		if _, ok := h.ready.Check(); !ok {
			st = healthpb.HealthCheckResponse_NOT_SERVING
		}
	}
	return &healthpb.HealthCheckResponse{Status: st}, nil
}
