package grpcload

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const method = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

// server answers each call with one status per descriptor of the request
// and its domain in raw_body, OVER_LIMIT for domain "over", and refuses a
// call without the bearer token. block, when set, holds calls until it is
// closed.
type server struct {
	rlpb.UnimplementedRateLimitServiceServer
	block chan struct{}
	body  int // bytes of raw_body besides the domain
}

func (s *server) ShouldRateLimit(ctx context.Context, req *rlpb.RateLimitRequest) (*rlpb.RateLimitResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer t" {
		return nil, status.Errorf(codes.Unauthenticated, "token %q", got)
	}
	if s.block != nil {
		<-s.block
	}
	if req.Domain == "trailer" {
		// Trailers over a frame: HEADERS ending the stream, then
		// CONTINUATIONs.
		grpc.SetTrailer(ctx, metadata.Pairs("big", strings.Repeat("t", 40<<10)))
	}
	resp := &rlpb.RateLimitResponse{OverallCode: rlpb.RateLimitResponse_OK, RawBody: []byte(req.Domain + strings.Repeat("x", s.body))}
	if req.Domain == "over" {
		resp.OverallCode = rlpb.RateLimitResponse_OVER_LIMIT
	}
	for range req.Descriptors {
		resp.Statuses = append(resp.Statuses, &rlpb.RateLimitResponse_DescriptorStatus{Code: resp.OverallCode})
	}
	return resp, nil
}

// serve starts a grpc-go server (default settings: a 64 KiB connection
// window it replenishes as it reads), stopped when the test ends, and
// returns its address and the server.
func serve(t *testing.T, s *server) (string, *grpc.Server) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	rlpb.RegisterRateLimitServiceServer(g, s)
	go g.Serve(ln)
	t.Cleanup(g.Stop)
	return ln.Addr().String(), g
}

func request(t *testing.T, domain string, n int) []byte {
	t.Helper()
	req := &rlpb.RateLimitRequest{Domain: domain}
	for i := range n {
		req.Descriptors = append(req.Descriptors, &rlv3.RateLimitDescriptor{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "user", Value: fmt.Sprint(i)}}})
	}
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func answer(t *testing.T, b []byte) *rlpb.RateLimitResponse {
	t.Helper()
	var resp rlpb.RateLimitResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		t.Fatal(err)
	}
	return &resp
}

// TestConcurrentCallsGetTheirOwnAnswers: calls from many goroutines on one
// connection, far more request bytes than the server's initial 64 KiB
// window (so its window updates must be honoured), some with trailers
// split over CONTINUATION frames, each answered with its own request's
// domain and descriptor count.
func TestConcurrentCallsGetTheirOwnAnswers(t *testing.T) {
	addr, _ := serve(t, &server{})
	c, err := Dial(addr, method, "authorization", "Bearer t")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const goroutines, calls = 32, 150
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Go(func() {
			var resp []byte
			for i := range calls {
				n := 1 + (g+i)%5
				domain := fmt.Sprintf("d%d-%d", g, i)
				switch {
				case i%7 == 0:
					domain = "over"
				case i%11 == 0:
					domain = "trailer"
				}
				var err error
				resp, err = c.Call(request(t, domain, n), resp)
				if err != nil {
					errs <- err
					return
				}
				a := answer(t, resp)
				want := rlpb.RateLimitResponse_OK
				if domain == "over" {
					want = rlpb.RateLimitResponse_OVER_LIMIT
				}
				if string(a.RawBody) != domain || len(a.Statuses) != n || a.OverallCode != want {
					errs <- fmt.Errorf("call %s with %d descriptors: answer %q, %d statuses, %v", domain, n, a.RawBody, len(a.Statuses), a.OverallCode)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestLargeAnswers: answers larger than a frame, and more of them than
// the connection's receive window would hold without the window updates
// the client sends, arrive whole.
func TestLargeAnswers(t *testing.T) {
	defer func(w uint32) { window = w }(window)
	window = 256 << 10
	addr, _ := serve(t, &server{body: 100 << 10})
	c, err := Dial(addr, method, "authorization", "Bearer t")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var resp []byte
	for i := range 40 {
		if resp, err = c.Call(request(t, "big", 1), resp); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if a := answer(t, resp); len(a.RawBody) != 3+100<<10 {
			t.Fatalf("call %d: a body of %d bytes", i, len(a.RawBody))
		}
	}
}

// TestStatusError: a refused call is a *StatusError with the server's code
// and message, and the connection goes on serving.
func TestStatusError(t *testing.T) {
	addr, _ := serve(t, &server{})
	bad, err := Dial(addr, method, "authorization", "Bearer wrong")
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	_, err = bad.Call(request(t, "d", 1), nil)
	var se *StatusError
	if !errors.As(err, &se) || se.Code != int(codes.Unauthenticated) || !strings.Contains(se.Message, "wrong") {
		t.Fatalf("got %v, want Unauthenticated naming the token", err)
	}
	other, err := Dial(addr, "/envoy.service.ratelimit.v3.RateLimitService/Nope", "authorization", "Bearer t")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err = other.Call(request(t, "d", 1), nil); !errors.As(err, &se) || se.Code != int(codes.Unimplemented) {
		t.Fatalf("an unknown method: got %v, want Unimplemented", err)
	}
	if _, err = bad.Call(request(t, "d", 1), nil); !errors.As(err, &se) {
		t.Fatalf("second call: got %v, want a StatusError again", err)
	}
}

// TestCloseAnswersCallsInFlight: calls waiting on the server end with an
// error when the connection closes, and later calls fail at once.
func TestCloseAnswersCallsInFlight(t *testing.T) {
	s := &server{block: make(chan struct{})}
	defer close(s.block)
	addr, _ := serve(t, s)
	c, err := Dial(addr, method, "authorization", "Bearer t")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 8)
	for range 8 {
		go func() {
			_, err := c.Call(request(t, "d", 1), nil)
			done <- err
		}()
	}
	time.Sleep(50 * time.Millisecond) // let the calls go out; the test holds either way
	c.Close()
	for range 8 {
		if err := <-done; err == nil {
			t.Fatal("a call in flight answered without error after Close")
		}
	}
	if _, err := c.Call(request(t, "d", 1), nil); err == nil {
		t.Fatal("a call after Close succeeded")
	}
}

// TestServerGone: a server that stops fails the calls in flight.
func TestServerGone(t *testing.T) {
	s := &server{block: make(chan struct{})}
	addr, g := serve(t, s)
	c, err := Dial(addr, method, "authorization", "Bearer t")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() {
		_, err := c.Call(request(t, "d", 1), nil)
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	g.Stop()
	close(s.block)
	if err := <-done; err == nil {
		t.Fatal("a call answered without error after the server stopped")
	}
}

// rawPeer serves one HTTP/2 connection at the frame level, for what a
// grpc-go server never does: it reads the preface, sends settings, then
// hands every frame the client sends to handle (with the connection's
// HPACK encoder) until handle returns false or the connection ends.
func rawPeer(t *testing.T, settings []http2.Setting, handle func(p *peer, f http2.Frame) bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		if _, err := io.ReadFull(nc, make([]byte, len(http2.ClientPreface))); err != nil {
			return
		}
		p := &peer{Framer: http2.NewFramer(nc, nc)}
		p.enc = hpack.NewEncoder(&p.hb)
		p.WriteSettings(settings...)
		for {
			f, err := p.ReadFrame()
			if err != nil || !handle(p, f) {
				return
			}
		}
	}()
	return ln.Addr().String()
}

type peer struct {
	*http2.Framer
	hb  bytes.Buffer
	enc *hpack.Encoder
}

// block encodes header fields name, value, ….
func (p *peer) block(fs ...string) []byte {
	p.hb.Reset()
	for i := 0; i < len(fs); i += 2 {
		p.enc.WriteField(hpack.HeaderField{Name: fs[i], Value: fs[i+1]})
	}
	return append([]byte(nil), p.hb.Bytes()...)
}

// answer sends stream id a whole answer: headers, an empty message and
// trailers fields.
func (p *peer) answer(id uint32, trailers ...string) {
	p.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, BlockFragment: p.block(":status", "200", "content-type", "application/grpc")})
	p.WriteData(id, false, []byte{0, 0, 0, 0, 0})
	p.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, EndStream: true, BlockFragment: p.block(trailers...)})
}

func dialT(t *testing.T, addr string) *Conn {
	t.Helper()
	c, err := Dial(addr, "/x.Y/Z")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	// A call that never ends fails the test instead of hanging it.
	watchdog := time.AfterFunc(time.Minute, func() {
		t.Error("a call still unanswered after a minute: the connection is closed")
		c.Close()
	})
	t.Cleanup(func() { watchdog.Stop() })
	return c
}

// callAll makes n calls of msg on c at once and waits for them; each must
// succeed.
func callAll(t *testing.T, c *Conn, n int, msg []byte) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if _, err := c.Call(msg, nil); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
}

// TestSendWindowKept: a peer that grants no connection window beyond
// HTTP/2's initial 65,535 bytes until the client has acknowledged a PING
// it sends after 4 calls of 16,000 bytes (so whatever the client sent
// before seeing the grant arrives first) never receives more than it
// granted; once it grants more, every call is answered.
func TestSendWindowKept(t *testing.T) {
	const calls, size = 8, 16000
	var (
		received int
		granted  = 65535
		held     []uint32
		pinged   bool
	)
	addr := rawPeer(t, nil, func(p *peer, f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.DataFrame:
			received += int(f.Length)
			if received > granted {
				t.Errorf("%d DATA bytes received, %d granted", received, granted)
			}
			held = append(held, f.StreamID)
			if len(held) == 4 && !pinged {
				pinged = true
				p.WritePing(false, [8]byte{1})
			}
		case *http2.PingFrame:
			if f.IsAck() {
				granted += 1 << 20
				p.WriteWindowUpdate(0, 1<<20)
			}
		}
		// Answered once every call is in: a call waiting for window
		// must be woken by the grant itself, not by an answer.
		if received == calls*size {
			for _, id := range held {
				p.answer(id, "grpc-status", "0")
			}
			held = held[:0]
		}
		return true
	})
	callAll(t, dialT(t, addr), calls, make([]byte, size-5))
}

// TestConcurrentStreamsKept: calls beyond the peer's
// SETTINGS_MAX_CONCURRENT_STREAMS wait for a stream to end: with 2 open,
// the peer sends a PING and answers them only once it is acknowledged
// (whatever the client sent before arrives first), and never sees a third.
func TestConcurrentStreamsKept(t *testing.T) {
	var open []uint32
	addr := rawPeer(t, []http2.Setting{{ID: http2.SettingMaxConcurrentStreams, Val: 2}}, func(p *peer, f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.DataFrame:
			open = append(open, f.StreamID)
			if len(open) > 2 {
				t.Errorf("%d streams open, the peer allows 2", len(open))
			}
			if len(open) == 2 {
				p.WritePing(false, [8]byte{2})
			}
		case *http2.PingFrame:
			if f.IsAck() {
				for _, id := range open {
					p.answer(id, "grpc-status", "0")
				}
				open = open[:0]
			}
		}
		return true
	})
	callAll(t, dialT(t, addr), 10, []byte("x"))
}

// TestStreamEnds: how each way a stream can end reaches its call: a reset
// fails that call only; trailers split over HEADERS (ending the stream)
// and a CONTINUATION answer it, and fail it when they lack grpc-status; a
// GOAWAY fails the calls above its last stream id, lets the others be
// answered, and refuses new calls.
func TestStreamEnds(t *testing.T) {
	var held uint32
	addr := rawPeer(t, nil, func(p *peer, f http2.Frame) bool {
		d, ok := f.(*http2.DataFrame)
		if !ok {
			return true
		}
		id := d.StreamID
		switch string(d.Data()[5:]) {
		case "reset":
			p.WriteRSTStream(id, http2.ErrCodeCancel)
		case "split", "split-no-status":
			p.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, BlockFragment: p.block(":status", "200")})
			p.WriteData(id, false, []byte{0, 0, 0, 0, 1, 'a'})
			fields := []string{"x-a", strings.Repeat("a", 100), "grpc-status", "0"}
			if string(d.Data()[5:]) == "split-no-status" {
				fields = fields[:2]
			}
			b := p.block(fields...)
			p.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndStream: true, BlockFragment: b[:len(b)/2]})
			p.WriteContinuation(id, true, b[len(b)/2:])
		case "hold":
			held = id
		case "goaway":
			// The held call is the last processed; this one, above it,
			// is dropped.
			p.WriteGoAway(held, http2.ErrCodeNo, []byte("draining"))
			p.answer(held, "grpc-status", "0")
		default:
			p.answer(id, "grpc-status", "0")
		}
		return true
	})
	c := dialT(t, addr)
	if _, err := c.Call([]byte("reset"), nil); err == nil || !strings.Contains(err.Error(), "reset") {
		t.Errorf("a reset stream: %v, want its reset", err)
	}
	if resp, err := c.Call([]byte("split"), nil); err != nil || string(resp) != "a" {
		t.Errorf("trailers over HEADERS and CONTINUATION: %q, %v; want \"a\"", resp, err)
	}
	if _, err := c.Call([]byte("split-no-status"), nil); err == nil || !strings.Contains(err.Error(), "grpc-status") {
		t.Errorf("trailers without grpc-status: %v, want an error naming it", err)
	}
	if _, err := c.Call([]byte("ok"), nil); err != nil {
		t.Errorf("a call after those: %v", err)
	}
	// A call the peer holds, then one that brings a GOAWAY naming the
	// first as the last processed: the first is answered, the second
	// fails, and later calls are refused.
	first := make(chan error, 1)
	go func() {
		_, err := c.Call([]byte("hold"), nil)
		first <- err
	}()
	for c.pending() == 0 {
		select {
		case err := <-first:
			t.Fatalf("the held call ended early: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	if _, err := c.Call([]byte("goaway"), nil); err == nil || !strings.Contains(err.Error(), "GOAWAY") {
		t.Errorf("a call above the GOAWAY's last stream: %v, want failed by it", err)
	}
	if err := <-first; err != nil {
		t.Errorf("the call the GOAWAY names as last: %v, want answered", err)
	}
	if _, err := c.Call([]byte("ok"), nil); err == nil || !strings.Contains(err.Error(), "GOAWAY") {
		t.Errorf("a call after GOAWAY: %v, want refused", err)
	}
}

// pending is the number of calls in flight.
func (c *Conn) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

// TestRequestSize: a request is one DATA frame: over the peer's frame size
// (or HTTP/2's initial stream window when frames may be larger) it fails
// at once, without going out.
func TestRequestSize(t *testing.T) {
	for _, c := range []struct {
		frame      uint32 // the peer's SETTINGS_MAX_FRAME_SIZE, 0: the default 16,384
		fits, over int    // message bytes (the frame adds gRPC's 5)
	}{{0, 16379, 16380}, {1 << 20, 65530, 65531}} {
		var settings []http2.Setting
		if c.frame != 0 {
			settings = append(settings, http2.Setting{ID: http2.SettingMaxFrameSize, Val: c.frame})
		}
		addr := rawPeer(t, settings, func(p *peer, f http2.Frame) bool {
			if d, ok := f.(*http2.DataFrame); ok && d.StreamEnded() {
				p.answer(d.StreamID, "grpc-status", "0")
			}
			return true
		})
		conn := dialT(t, addr)
		if _, err := conn.Call(make([]byte, c.fits), nil); err != nil {
			t.Errorf("frame size %d: a message of %d bytes: %v", c.frame, c.fits, err)
		}
		if _, err := conn.Call(make([]byte, c.over), nil); err == nil || !strings.Contains(err.Error(), "more than one frame") {
			t.Errorf("frame size %d: a message of %d bytes: %v, want refused", c.frame, c.over, err)
		}
	}
}

// TestSmallHeaderTable: a peer whose HPACK table is 0 bytes gets every
// call's header fields as literals, each block opening with the table
// size update to 0 that such a decoder expects.
func TestSmallHeaderTable(t *testing.T) {
	var (
		mu    sync.Mutex // paths: written by the peer, read by the test
		paths []string
	)
	dec := hpack.NewDecoder(0, func(f hpack.HeaderField) {
		if f.Name == ":path" {
			mu.Lock()
			paths = append(paths, f.Value)
			mu.Unlock()
		}
	})
	addr := rawPeer(t, []http2.Setting{{ID: http2.SettingHeaderTableSize, Val: 0}}, func(p *peer, f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.HeadersFrame:
			if b := f.HeaderBlockFragment(); len(b) == 0 || b[0] != 0x20 {
				t.Errorf("a header block opening %x, want a size update to 0 (20)", b[:min(len(b), 1)])
			}
			if _, err := dec.Write(f.HeaderBlockFragment()); err != nil {
				t.Error(err)
			}
		case *http2.DataFrame:
			p.answer(f.StreamID, "grpc-status", "0")
		}
		return true
	})
	c := dialT(t, addr)
	for range 3 {
		if _, err := c.Call([]byte("x"), nil); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(paths) != 3 || paths[2] != "/x.Y/Z" {
		t.Errorf("paths decoded: %q, want /x.Y/Z three times", paths)
	}
}
