// Package load is the benchmarks' one load generator: HTTP/1.1 over
// keep-alive TCP connections, one goroutine per connection, as cheap per
// request as wrk, so that what it measures is the server and not the client
// (net/http's client costs several times more CPU per request than the
// servers it would compare).
//
// Each connection writes a request its Client builds into a reused buffer,
// reads the answer by its status line and Content-Length (chunked answers
// are refused: no target sends them) and records the latency in a
// fixed-bucket Histogram. Run drives the connections in a closed loop (each
// sends its next request when the answer to the last one is in) or, with a
// Rate, in an open loop: requests are due on one fixed schedule that the
// connections share, each taking the next request due when its last answer
// is in, as a gateway's pool of connections would; latency counts from
// when a request was due, not when it could be sent, so a stalled server
// shows in the percentiles instead of slowing the load (coordinated
// omission). A slow answer delays only its own connection: requests wait in
// the generator only while every connection is busy (by Little's law, once
// Conns / Rate is less than the latency): Result.ConnWait shows that wait,
// Result.Lag the generator's own lateness beside it.
package load

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Client makes the requests of one connection. Run calls its methods from
// that connection's goroutine only, so it needs no locking of its own.
type Client interface {
	// Next appends the connection's next request, a whole HTTP/1.1
	// request, to buf and returns it.
	Next(buf []byte) []byte
	// Response sees the answer to the request Next wrote last: its
	// status, its body (only valid until Response returns) and its
	// latency. A request that got no answer (the connection failed) is
	// not seen; Next is asked for a new one.
	Response(status int, body []byte, latency time.Duration)
}

// A Sequencer is a Client whose requests come in sequences that must not
// be cut, such as an admit and the usage report of the request it
// admitted: a closed-loop Run that reaches its Duration lets each
// connection send its requests while InSequence holds (bounded by
// Timeout).
type Sequencer interface {
	Client
	// InSequence reports whether the request Next would write now
	// continues a sequence.
	InSequence() bool
}

// Config says what Run sends where.
type Config struct {
	Addr     string        // host:port
	Conns    int           // connections, each with a goroutine of its own
	Duration time.Duration // no request (closed loop: no sequence, see Sequencer) begins after it
	// Rate is the total of requests per second due over all connections
	// (open loop); 0 is a closed loop.
	Rate float64
	// NewClient returns the Client of connection conn (0 ≤ conn < Conns).
	NewClient func(conn int) Client
	// Timeout bounds the wait for one answer after Duration ends (default
	// 10 s), so a stalled server cannot hang the run: it is every
	// connection's deadline, and an open loop counts the requests it has
	// not sent by then as errors.
	Timeout time.Duration
}

// Result is what a Run measured.
type Result struct {
	Requests uint64        // answers read
	Errors   uint64        // failed connections (each dialled again), unreadable answers and, in an open loop, requests left when the Timeout after Duration ran out
	Elapsed  time.Duration // from the start to the last answer
	ChildCPU time.Duration // the CPU of a load generator that ran as a process of its own (ghz), beside this one's
	Status   map[int]uint64
	Latency  Histogram
	// ConnWait counts, in an open loop, how long each answered request
	// waited for a free connection: from when it was due to when a
	// connection, its last answer read, took it (0 if taken before it was
	// due). It grows when slow answers hold every connection, so it is
	// the server's doing as much as the generator's.
	ConnWait Histogram
	// Lag counts, in an open loop, how late each answered request was
	// written after it was due or taken, whichever came last: the load
	// generator's own lateness (its timer, dial and scheduling).
	Lag     Histogram
	LastErr error // the last of Errors, for the log
}

// Rate is the answers per second.
func (r *Result) Rate() float64 { return float64(r.Requests) / max(r.Elapsed.Seconds(), 1e-9) }

// Statuses lists the answers by status, e.g. "9998×200 2×429".
func (r *Result) Statuses() string {
	var parts []string
	for _, c := range slices.Sorted(maps.Keys(r.Status)) {
		parts = append(parts, fmt.Sprintf("%d×%d", r.Status[c], c))
	}
	if r.Errors > 0 {
		parts = append(parts, fmt.Sprintf("%d errors", r.Errors))
	}
	return strings.Join(parts, " ")
}

// Run loads cfg.Addr until cfg.Duration has passed or ctx ends, then waits
// for the answers in flight. It fails only on a bad Config or when no
// connection could be made at all.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.Conns < 1 || cfg.Duration <= 0 || cfg.Rate < 0 || cfg.NewClient == nil || cfg.Addr == "" {
		return nil, fmt.Errorf("load: config needs Addr, Conns ≥ 1, Duration > 0, Rate ≥ 0 and NewClient")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	start := time.Now()
	var sched *schedule
	if cfg.Rate > 0 {
		sched = &schedule{start: start, every: 1e9 / cfg.Rate}
	}
	ws := make([]*worker, cfg.Conns)
	var wg sync.WaitGroup
	for i := range ws {
		w := &worker{cfg: &cfg, client: cfg.NewClient(i), sched: sched, end: start.Add(cfg.Duration)}
		ws[i] = w
		wg.Go(func() { w.run(ctx) })
	}
	wg.Wait()
	res := &Result{Elapsed: time.Since(start), Status: map[int]uint64{}}
	for _, w := range ws {
		res.Requests += w.requests
		res.Errors += w.errors
		res.Latency.Merge(&w.hist)
		res.ConnWait.Merge(&w.connWait)
		res.Lag.Merge(&w.lag)
		for code, n := range w.status {
			if n > 0 {
				res.Status[code] += n
			}
		}
		if w.lastErr != nil {
			res.LastErr = w.lastErr
		}
	}
	if res.Requests == 0 && res.LastErr != nil {
		return res, fmt.Errorf("load %s: no answer: %w", cfg.Addr, res.LastErr)
	}
	return res, nil
}

// schedule is an open loop's: request k is due every × k nanoseconds after
// start, and the connections take the next one in turn.
type schedule struct {
	start time.Time
	every float64 // ns
	next  atomic.Int64
}

// take returns when the next request not yet taken is due.
func (s *schedule) take() time.Time {
	k := s.next.Add(1) - 1
	return s.start.Add(time.Duration(float64(k) * s.every))
}

// worker is one connection's loop and its counts, merged by Run at the end.
type worker struct {
	cfg       *Config
	client    Client
	sched     *schedule // open loop; nil in a closed one
	end       time.Time
	timer     *time.Timer // open loop: the wait until a request is due
	conn      net.Conn
	rd        *bufio.Reader
	buf, body []byte
	hist      Histogram
	connWait  Histogram // open loop
	lag       Histogram // open loop
	status    [600]uint64
	requests  uint64
	errors    uint64
	lastErr   error
}

func (w *worker) run(ctx context.Context) {
	defer func() {
		if w.conn != nil {
			w.conn.Close()
		}
	}()
	for ctx.Err() == nil {
		// The closed loop ends with the clock; the open loop with its
		// schedule, so that it sends exactly the requests due before the
		// end even when it runs late.
		var due, taken time.Time
		if w.sched != nil {
			due, taken = w.sched.take(), time.Now()
			if !due.Before(w.end) {
				return
			}
			// Past the connections' deadline a request can only fail:
			// count it without dialling a connection for it.
			if !taken.Before(w.end.Add(w.cfg.Timeout)) {
				w.fail(errPastDeadline)
				continue
			}
		} else if now := time.Now(); !now.Before(w.end) && (!w.inSequence() || now.After(w.end.Add(w.cfg.Timeout))) {
			return
		}
		if w.conn == nil && !w.dial(ctx) {
			continue
		}
		sent := time.Now()
		if w.sched != nil {
			if wait := due.Sub(sent); wait > 0 {
				if w.timer == nil {
					w.timer = time.NewTimer(wait)
				} else {
					w.timer.Reset(wait)
				}
				select {
				case <-w.timer.C:
				case <-ctx.Done():
					return
				}
			}
		}
		w.buf = w.client.Next(w.buf[:0])
		var connWait, lag time.Duration
		if w.sched != nil {
			connWait = max(0, taken.Sub(due))
			lag = time.Since(due.Add(connWait)) // from max(due, taken)
			sent = due                          // latency counts from when the request was due
		}
		if _, err := w.conn.Write(w.buf); err != nil {
			w.fail(err)
			continue
		}
		status, body, err := w.read()
		if err != nil {
			w.fail(err)
			continue
		}
		lat := time.Since(sent)
		w.hist.Record(lat)
		if w.sched != nil {
			w.connWait.Record(connWait)
			w.lag.Record(lag)
		}
		w.status[status]++
		w.requests++
		w.client.Response(status, body, lat)
	}
}

// inSequence reports whether the worker's Client is a Sequencer in the
// middle of a sequence.
func (w *worker) inSequence() bool {
	s, ok := w.client.(Sequencer)
	return ok && s.InSequence()
}

func (w *worker) dial(ctx context.Context) bool {
	d := net.Dialer{Timeout: w.cfg.Timeout}
	c, err := d.DialContext(ctx, "tcp", w.cfg.Addr)
	if err != nil {
		w.fail(err)
		select { // do not spin on a server that is down
		case <-time.After(10 * time.Millisecond):
		case <-ctx.Done():
		}
		return false
	}
	_ = c.SetDeadline(w.end.Add(w.cfg.Timeout))
	w.conn = c
	if w.rd == nil {
		w.rd = bufio.NewReaderSize(c, 32<<10)
	} else {
		w.rd.Reset(c)
	}
	return true
}

func (w *worker) fail(err error) {
	w.errors++
	w.lastErr = err
	if w.conn != nil {
		w.conn.Close()
		w.conn = nil
	}
}

var (
	errPastDeadline = errors.New("due after the connections' deadline (end + Timeout)")
	errChunked      = errors.New("chunked answer: not supported")
	errLength       = errors.New("answer without Content-Length")
)

// read reads one answer: the status line, the headers (for Content-Length
// and Connection: close) and the body, into the worker's reused buffer.
func (w *worker) read() (status int, body []byte, err error) {
	line, err := w.rd.ReadSlice('\n')
	if err != nil {
		return 0, nil, err
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return 0, nil, fmt.Errorf("bad status line %q", line)
	}
	status, ok := digits(line[9:12])
	if !ok || status < 100 || status >= len(w.status) {
		return 0, nil, fmt.Errorf("bad status line %q", line)
	}
	length, closing := -1, false
	for {
		h, err := w.rd.ReadSlice('\n')
		if err != nil {
			return 0, nil, err
		}
		if len(h) <= 2 { // the blank line
			break
		}
		name, value, ok := bytes.Cut(h, []byte(":"))
		if !ok {
			return 0, nil, fmt.Errorf("bad header %q", h)
		}
		value = bytes.TrimSpace(value)
		switch {
		case asciiEqualFold(name, "content-length"):
			n, ok := digits(value)
			if !ok {
				return 0, nil, fmt.Errorf("bad Content-Length %q", value)
			}
			length = n
		case asciiEqualFold(name, "transfer-encoding"):
			return 0, nil, errChunked
		case asciiEqualFold(name, "connection"):
			closing = asciiEqualFold(value, "close")
		}
	}
	if length < 0 {
		if status != 204 && status != 304 && status >= 200 {
			return 0, nil, errLength
		}
		length = 0
	}
	if cap(w.body) < length {
		w.body = make([]byte, length)
	}
	w.body = w.body[:length]
	if _, err := io.ReadFull(w.rd, w.body); err != nil {
		return 0, nil, err
	}
	if closing { // the answer is whole; dial again for the next request
		w.conn.Close()
		w.conn = nil
	}
	return status, w.body, nil
}

// digits parses a decimal of up to 9 digits, without the allocation of
// converting to a string for strconv.
func digits(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 9 {
		return 0, false
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// Post is the fixed part of a POST request, its request line and headers,
// built once; Append adds the length and a body.
type Post struct{ head []byte }

// NewPost prepares POSTs of JSON bodies to path on host, with extra
// header lines ("Authorization: Bearer …") if any.
func NewPost(host, path string, header ...string) Post {
	var b strings.Builder
	b.WriteString("POST " + path + " HTTP/1.1\r\nHost: " + host + "\r\nContent-Type: application/json\r\n")
	for _, h := range header {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("Content-Length: ")
	return Post{head: []byte(b.String())}
}

// Append appends the request carrying body to buf.
func (p Post) Append(buf, body []byte) []byte {
	buf = append(buf, p.head...)
	buf = strconv.AppendInt(buf, int64(len(body)), 10)
	buf = append(buf, "\r\n\r\n"...)
	return append(buf, body...)
}

// Users returns clients that POST to path, each request for a random one
// of users (0 ≤ user < users): body appends the JSON body for a user to
// dst. Each connection draws from a generator of its own, seeded with its
// number, so a run's sequence of users repeats.
func Users(post Post, users int, body func(dst []byte, user int) []byte) func(conn int) Client {
	return func(conn int) Client {
		return &usersClient{post: post, users: users, body: body, rnd: rand.New(rand.NewPCG(uint64(conn), 13))}
	}
}

type usersClient struct {
	post    Post
	users   int
	body    func(dst []byte, user int) []byte
	rnd     *rand.Rand
	scratch []byte
}

func (c *usersClient) Next(buf []byte) []byte {
	c.scratch = c.body(c.scratch[:0], c.rnd.IntN(c.users))
	return c.post.Append(buf, c.scratch)
}

func (c *usersClient) Response(int, []byte, time.Duration) {}

// Ints parses a flag's comma-separated list of integers, each at least
// least (the benchmarks' concurrencies, events per message, ...).
func Ints(s string, least int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%q: want integers, comma-separated", s)
		}
		if v < least {
			return nil, fmt.Errorf("%q: want integers of at least %d", s, least)
		}
		out = append(out, v)
	}
	return out, nil
}
