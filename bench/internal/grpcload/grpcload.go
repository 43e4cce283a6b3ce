// Package grpcload is the benchmarks' gRPC client: unary calls over
// cleartext HTTP/2 (h2c, prior knowledge), as cheap per call as the
// servers it compares, so that on a shared host what a run measures is the
// server and not the client. grpc-go's client spends nearly as much CPU
// per ShouldRateLimit call as admission's server does (bench/results.md,
// "A lean gRPC client"): each call crosses its writer goroutine and its
// reader's buffers, and allocates its stream, context and metadata.
//
// Here a caller queues its call's HEADERS and DATA frames itself and
// writes them out unless another caller is writing, whose next write then
// carries them (no writer goroutine; under concurrent calls one system
// call carries many); one reader goroutine per connection hands each
// answer to its caller. The request's header fields are the same for
// every call: the first call sends them to be indexed in the server's
// HPACK table and every later one refers to them, as Envoy's and grpc-go's
// clients do (or, if the server's table is too small for them, each call
// sends them as literals never indexed). Flow control is honoured both
// ways: a call waits for connection window to send, and the connection's
// receive window is replenished as answers arrive (a stream's own window
// is far larger than one answer). Calls beyond the server's
// SETTINGS_MAX_CONCURRENT_STREAMS wait for a stream to end.
//
// Limits, as a load generator's: a request is one DATA frame within the
// server's initial stream window and frame size, a Conn makes at most
// 2^30 calls and is not dialled again when it fails, and a server that
// shrinks its header table after its first SETTINGS fails the Conn.
package grpcload

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"strconv"
	"sync"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// EnvoyWindow is Envoy's default HTTP/2 stream and connection window
// (http2_protocol_options initial_stream_window_size and
// initial_connection_window_size): fixed, no bandwidth-delay pings.
const EnvoyWindow = 256 << 20

// window is the receive window this client advertises, per stream and for
// the connection: Envoy's, so the server never waits for a window update,
// as it would not with Envoy. A variable for the test of its replenishing
// (at least 65535).
var window uint32 = EnvoyWindow

// maxMessage caps an answer's gRPC message.
const maxMessage = 4 << 20

// StatusError is a call's non-zero grpc-status.
type StatusError struct {
	Code    int
	Message string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("grpc-status %d: %s", e.Code, e.Message)
}

// Conn is one HTTP/2 connection making unary calls of one method. Its
// methods are safe for concurrent use.
type Conn struct {
	nc     net.Conn
	window uint32        // the receive window advertised
	fr     *http2.Framer // reads, in the reader only
	closed chan struct{} // the reader has ended

	wmu      sync.Mutex
	wcond    *sync.Cond // signalled when a call may go: window, a stream ended, the conn failed
	out      []byte     // frames to write
	spare    []byte     // the flushed buffer, for reuse
	flushing bool       // a caller is writing out
	first    []byte     // the header block of the first call (fields to index)
	block    []byte     // the header block of every later call
	literal  []byte     // every call's block when the server's table is too small
	nextID   uint32
	sendWin  int64  // connection window for our DATA
	maxFrame uint32 // the server's SETTINGS_MAX_FRAME_SIZE
	maxData  uint32 // the largest DATA payload a call may send: frame size, initial stream window
	streams  uint32 // calls in flight
	maxConc  uint32 // the server's SETTINGS_MAX_CONCURRENT_STREAMS
	tableMin uint32 // the bytes of the server's header table the fields take
	indexed  bool   // calls after the first refer to the server's table

	mu    sync.Mutex
	calls map[uint32]*call
	err   error // why the connection ended, or no new call may start
}

// call is one call in flight; the reader fills it and signals done.
type call struct {
	done   chan struct{}
	resp   []byte
	status int
	msg    string
	sawEnd bool // grpc-status came
	err    error
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// Dial connects to addr, waits for the server's SETTINGS and prepares
// calls of path (a gRPC method, "/package.Service/Method") with the
// metadata md (name, value pairs, lowercase names).
func Dial(addr, path string, md ...string) (*Conn, error) {
	if len(md)%2 != 0 {
		return nil, errors.New("grpcload: metadata wants name, value pairs")
	}
	if window < 65535 {
		return nil, fmt.Errorf("grpcload: a receive window of %d, under HTTP/2's initial 65535", window)
	}
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &Conn{nc: nc, window: window, closed: make(chan struct{}), calls: map[uint32]*call{}, nextID: 1,
		sendWin: 65535, maxFrame: 16384, maxData: 16384, maxConc: math.MaxUint32}
	c.wcond = sync.NewCond(&c.wmu)
	c.fr = http2.NewFramer(nil, bufio.NewReaderSize(nc, 64<<10))
	c.fr.SetReuseFrames()

	fields := []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"},
		{Name: ":path", Value: path}, {Name: ":authority", Value: addr},
		{Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}}
	for i := 0; i < len(md); i += 2 {
		fields = append(fields, hpack.HeaderField{Name: md[i], Value: md[i+1]})
	}
	var first, block, literal []byte
	enc := hpack.NewEncoder(byteWriter{&first})
	for _, f := range fields {
		enc.WriteField(f) // incremental indexing: these fields enter both tables
		c.tableMin += f.Size()
	}
	enc = hpack.NewEncoder(byteWriter{&block})
	for _, f := range fields {
		enc.WriteField(f)
	}
	// The second encoder indexed as the first did: encode with it again
	// for the block that refers to the table.
	block = block[:0]
	for _, f := range fields {
		enc.WriteField(f)
	}
	lit := hpack.NewEncoder(byteWriter{&literal})
	// Each literal block starts with a table size update to 0, as a
	// server whose table is smaller than HPACK's initial one needs.
	lit.SetMaxDynamicTableSizeLimit(0)
	for _, f := range fields {
		f.Sensitive = true // never indexed: the block can be sent again as it is
		lit.WriteField(f)
	}

	if len(first) > 16384 || len(literal) > 16384 {
		nc.Close()
		return nil, errors.New("grpcload: request headers over one frame")
	}
	c.first, c.block, c.literal = first, block, literal

	ready := make(chan struct{}) // closed once the server's first SETTINGS is taken
	c.out = append(c.out, http2.ClientPreface...)
	var settings [12]byte
	binary.BigEndian.PutUint16(settings[0:], uint16(http2.SettingInitialWindowSize))
	binary.BigEndian.PutUint32(settings[2:], c.window)
	binary.BigEndian.PutUint16(settings[6:], uint16(http2.SettingEnablePush))
	c.out = frame(c.out, http2.FrameSettings, 0, 0, settings[:])
	if c.window > 65535 {
		c.out = windowUpdate(c.out, c.window-65535)
	}
	c.wmu.Lock()
	if err := c.flush(); err != nil {
		nc.Close()
		return nil, err
	}
	go c.read(ready)
	select {
	case <-ready:
		if err := c.failed(); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	case <-c.closed:
		return nil, fmt.Errorf("grpcload: no SETTINGS from %s: %w", addr, c.failed())
	}
}

type byteWriter struct{ b *[]byte }

func (w byteWriter) Write(p []byte) (int, error) { *w.b = append(*w.b, p...); return len(p), nil }

// Call sends msg (a marshalled request) and returns the answer's message
// appended to resp[:0]. A non-zero grpc-status is a *StatusError.
func (c *Conn) Call(msg, resp []byte) ([]byte, error) {
	var prefix [5]byte
	binary.BigEndian.PutUint32(prefix[1:], uint32(len(msg)))
	n := int64(len(prefix) + len(msg))
	c.wmu.Lock()
	for (c.sendWin < n || c.streams >= c.maxConc) && n <= int64(c.maxData) && c.failed() == nil {
		c.wcond.Wait()
	}
	if n > int64(c.maxData) { // checked after the wait too: a SETTINGS may lower it
		c.wmu.Unlock()
		return resp, fmt.Errorf("grpcload: a request of %d bytes, more than one frame or the initial stream window (%d)", n, c.maxData)
	}
	if c.nextID > 1<<31-1 {
		c.wmu.Unlock()
		return resp, errors.New("grpcload: the connection's stream ids are spent")
	}
	cl := callPool.Get().(*call)
	cl.resp = resp[:0]
	c.mu.Lock()
	if err := c.err; err != nil {
		c.mu.Unlock()
		c.wmu.Unlock()
		callPool.Put(cl)
		return resp, err
	}
	id := c.nextID
	c.nextID += 2
	c.calls[id] = cl // the reader answers it, even when the write fails
	c.mu.Unlock()
	c.sendWin -= n
	c.streams++
	block := c.block
	if id == 1 {
		block = c.first
	}
	c.out = frame(c.out, http2.FrameHeaders, byte(http2.FlagHeadersEndHeaders), id, block)
	// One DATA frame ending the stream: the 5-byte gRPC prefix and msg.
	c.out = frame(c.out, http2.FrameData, byte(http2.FlagDataEndStream), id, prefix[:], msg)
	if err := c.flush(); err != nil {
		c.fail(err)
	}
	<-cl.done
	resp, err := cl.resp, cl.err
	if err == nil && cl.status != 0 {
		err = &StatusError{Code: cl.status, Message: cl.msg}
	}
	*cl = call{done: cl.done}
	callPool.Put(cl)
	return resp, err
}

// flush, called with wmu held, writes out c.out unless another caller is
// already at it, and returns with wmu released: under concurrent calls
// one system call carries the frames of many. What queues while a write
// is on goes out in the writer's next one.
func (c *Conn) flush() error {
	if c.flushing {
		c.wmu.Unlock()
		return nil
	}
	c.flushing = true
	for len(c.out) > 0 {
		buf := c.out
		c.out = c.spare[:0]
		c.wmu.Unlock()
		_, err := c.nc.Write(buf)
		c.wmu.Lock()
		c.spare = buf[:0]
		if err != nil {
			// No call may queue frames after the lost ones.
			c.mu.Lock()
			if c.err == nil {
				c.err = err
			}
			c.mu.Unlock()
			c.out = c.out[:0]
			c.flushing = false
			c.wmu.Unlock()
			return err
		}
	}
	c.flushing = false
	c.wmu.Unlock()
	return nil
}

// frame appends an HTTP/2 frame of type t with payload parts to b.
func frame(b []byte, t http2.FrameType, flags byte, id uint32, parts ...[]byte) []byte {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	b = append(b, byte(n>>16), byte(n>>8), byte(n), byte(t), flags)
	b = binary.BigEndian.AppendUint32(b, id)
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// windowUpdate appends a WINDOW_UPDATE of the connection by n to b.
func windowUpdate(b []byte, n uint32) []byte {
	var inc [4]byte
	binary.BigEndian.PutUint32(inc[:], n)
	return frame(b, http2.FrameWindowUpdate, 0, 0, inc[:])
}

// failed is why no new call may start, or nil.
func (c *Conn) failed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// fail ends the connection with err (the first reason stays); the reader
// then answers every call in flight.
func (c *Conn) fail(err error) {
	c.refuse(err)
	c.nc.Close()
}

// refuse lets no new call start, with err (the first reason stays), and
// wakes the calls waiting to.
func (c *Conn) refuse(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	c.mu.Unlock()
	c.wmu.Lock()
	c.wcond.Broadcast()
	c.wmu.Unlock()
}

// Close ends the connection; calls in flight fail.
func (c *Conn) Close() error {
	c.fail(net.ErrClosed)
	<-c.closed
	return nil
}

// read is the connection's reader: it answers calls until the connection
// fails, and then answers the calls left with why. Only the reader answers
// calls. It closes ready once the server's first SETTINGS is taken (and
// the header blocks chosen for its table).
func (c *Conn) read(ready chan struct{}) {
	defer close(c.closed)
	defer func() {
		c.mu.Lock()
		calls, err := c.calls, c.err
		c.calls = nil
		c.mu.Unlock()
		for _, cl := range calls {
			cl.err = err
			cl.done <- struct{}{}
		}
	}()
	var cur *call // the call whose header block is being decoded
	dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if cur == nil {
			return
		}
		switch f.Name {
		case "grpc-status":
			cur.sawEnd = true
			if n, err := strconv.Atoi(f.Value); err != nil {
				cur.status, cur.msg = 2, "bad grpc-status "+f.Value
			} else {
				cur.status = n
			}
		case "grpc-message":
			if m, err := url.PathUnescape(f.Value); err == nil {
				cur.msg = m
			} else {
				cur.msg = f.Value
			}
		case ":status":
			if f.Value != "200" {
				cur.status, cur.msg = 2, "HTTP status "+f.Value
			}
		}
	})
	var unacked uint32    // received DATA not yet given back to the connection window
	var headersOf uint32  // the stream of the header block being read
	var headersEnd bool   // that block's HEADERS ended the stream
	table := uint32(4096) // the server's header table size (HPACK's initial one)
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			c.fail(err)
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			c.wmu.Lock()
			err = f.ForeachSetting(func(s http2.Setting) error {
				switch s.ID {
				case http2.SettingMaxFrameSize:
					c.maxFrame = s.Val
				case http2.SettingInitialWindowSize:
					if s.Val < 65535 {
						return fmt.Errorf("grpcload: an initial stream window of %d", s.Val)
					}
				case http2.SettingMaxConcurrentStreams:
					c.maxConc = s.Val
				case http2.SettingHeaderTableSize:
					if ready == nil && c.indexed && s.Val < 4096 {
						return fmt.Errorf("grpcload: the server shrank its header table to %d after its first SETTINGS", s.Val)
					}
					table = s.Val
				}
				return nil
			})
			c.maxData = min(c.maxFrame, 65535)
			if ready != nil && err == nil {
				// The encoder's table is HPACK's initial 4096 bytes:
				// a server allowing less gets literals.
				if c.indexed = table >= 4096 && c.tableMin <= 4096; !c.indexed {
					c.first, c.block = c.literal, c.literal
				}
			}
			c.wcond.Broadcast()
			c.wmu.Unlock()
			if err == nil {
				err = c.control(func(b []byte) []byte { return frame(b, http2.FrameSettings, byte(http2.FlagSettingsAck), 0) })
			}
			if ready != nil && err == nil {
				close(ready)
				ready = nil
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				data := f.Data
				err = c.control(func(b []byte) []byte { return frame(b, http2.FramePing, byte(http2.FlagPingAck), 0, data[:]) })
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				c.wmu.Lock()
				c.sendWin += int64(f.Increment)
				c.wcond.Broadcast()
				c.wmu.Unlock()
			}
		case *http2.GoAwayFrame:
			// Calls up to its last stream id are still answered; those
			// above it were not processed and fail now.
			goaway := fmt.Errorf("grpcload: GOAWAY %v: %s", f.ErrCode, f.DebugData())
			c.refuse(goaway)
			c.mu.Lock()
			var dropped []*call
			for id, cl := range c.calls {
				if id > f.LastStreamID {
					dropped = append(dropped, cl)
					delete(c.calls, id)
				}
			}
			c.mu.Unlock()
			for _, cl := range dropped {
				cl.err = goaway
				c.answer(cl)
			}
		case *http2.RSTStreamFrame:
			if cl := c.take(f.StreamID); cl != nil {
				cl.err = fmt.Errorf("grpcload: stream reset: %v", f.ErrCode)
				c.answer(cl)
			}
		case *http2.HeadersFrame:
			headersOf, headersEnd = f.StreamID, f.StreamEnded()
			cur = c.peek(f.StreamID)
			if _, err = dec.Write(f.HeaderBlockFragment()); err == nil && f.HeadersEnded() {
				err = c.endHeaders(dec, f.StreamID, headersEnd, &cur)
			}
		case *http2.ContinuationFrame:
			// The framer refuses any other frame between a HEADERS
			// without END_HEADERS and its CONTINUATIONs.
			if _, err = dec.Write(f.HeaderBlockFragment()); err == nil && f.HeadersEnded() {
				err = c.endHeaders(dec, headersOf, headersEnd, &cur)
			}
		case *http2.DataFrame:
			data := f.Data()
			// Flow control counts the whole payload, padding too.
			if unacked += f.Length; unacked >= c.window/2 {
				n := unacked
				unacked = 0
				err = c.control(func(b []byte) []byte { return windowUpdate(b, n) })
			}
			if cl := c.peek(f.StreamID); cl != nil && cl.err == nil {
				if len(cl.resp)+len(data) > maxMessage+5 {
					cl.err = fmt.Errorf("grpcload: an answer over %d bytes", maxMessage)
				} else {
					cl.resp = append(cl.resp, data...)
				}
			}
			if f.StreamEnded() {
				if cl := c.take(f.StreamID); cl != nil {
					if cl.err == nil {
						cl.err = errors.New("grpcload: stream ended without trailers")
					}
					c.answer(cl)
				}
			}
		}
		if err != nil {
			c.fail(err)
			return
		}
	}
}

// endHeaders closes a header block of stream id; at the end of the stream
// (or on trailers) its call is answered.
func (c *Conn) endHeaders(dec *hpack.Decoder, id uint32, ended bool, cur **call) error {
	if err := dec.Close(); err != nil {
		return err
	}
	cl := *cur
	*cur = nil
	if cl == nil || !(ended || cl.sawEnd) {
		return nil
	}
	c.take(id)
	switch {
	case cl.err != nil || cl.status != 0:
	case !cl.sawEnd:
		cl.err = errors.New("grpcload: stream ended without grpc-status")
	default:
		cl.resp, cl.err = message(cl.resp)
	}
	c.answer(cl)
	return nil
}

// answer hands cl, taken from the calls in flight, to its caller and
// frees its stream for another call.
func (c *Conn) answer(cl *call) {
	c.wmu.Lock()
	c.streams--
	c.wcond.Broadcast()
	c.wmu.Unlock()
	cl.done <- struct{}{}
}

// message returns the one gRPC message in b, without its prefix, in b's
// array.
func message(b []byte) ([]byte, error) {
	if len(b) < 5 {
		return b[:0], fmt.Errorf("grpcload: an answer of %d bytes, no message", len(b))
	}
	if b[0] != 0 {
		return b[:0], errors.New("grpcload: a compressed answer")
	}
	n := binary.BigEndian.Uint32(b[1:5])
	if int(n) != len(b)-5 {
		return b[:0], fmt.Errorf("grpcload: a message of %d bytes in %d", n, len(b)-5)
	}
	return append(b[:0], b[5:]...), nil
}

func (c *Conn) peek(id uint32) *call {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[id]
}

func (c *Conn) take(id uint32) *call {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.calls[id]
	delete(c.calls, id)
	return cl
}

// control queues the frame add appends and writes it out.
func (c *Conn) control(add func([]byte) []byte) error {
	c.wmu.Lock()
	c.out = add(c.out)
	return c.flush()
}
