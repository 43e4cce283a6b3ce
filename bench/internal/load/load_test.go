package load

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// server answers each POST with the user of its body, 429 for users that
// are multiples of 5, and closes the connection after every 7th answer on
// it; it counts what it saw.
type server struct {
	mu       sync.Mutex
	requests int
	byStatus map[int]int
	bad      int
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body struct{ User int }
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	defer s.mu.Unlock()
	if r.Method != http.MethodPost || r.URL.Path != "/v1/x" || r.Header.Get("Authorization") != "Bearer t" || json.Unmarshal(b, &body) != nil {
		s.bad++
		http.Error(w, "bad", http.StatusBadRequest)
		return
	}
	s.requests++
	status := http.StatusOK
	if body.User%5 == 0 {
		status = http.StatusTooManyRequests
	}
	s.byStatus[status]++
	if s.requests%7 == 0 {
		w.Header().Set("Connection", "close")
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"user":%d}`, body.User)
}

// recorder is a Client that checks every answer carries its request's
// user and counts them.
type recorder struct {
	Client
	last  int
	seen  map[int]int
	wrong int
}

func (r *recorder) Next(buf []byte) []byte {
	buf = r.Client.Next(buf)
	_, body, _ := strings.Cut(string(buf), "\r\n\r\n")
	var b struct{ User int }
	_ = json.Unmarshal([]byte(body), &b)
	r.last = b.User
	return buf
}

func (r *recorder) Response(status int, body []byte, _ time.Duration) {
	if string(body) != `{"user":`+strconv.Itoa(r.last)+`}` || (status == 429) != (r.last%5 == 0) {
		r.wrong++
	}
	r.seen[status]++
}

func TestRun(t *testing.T) {
	for _, tc := range []struct {
		name string
		rate float64
		want uint64 // requests; 0: whatever the closed loop managed
	}{
		{"closed loop", 0, 0},
		// Due every 10 ms before 600 ms, however late they run.
		{"open loop", 100, 60},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := &server{byStatus: map[int]int{}}
			ts := httptest.NewServer(srv)
			defer ts.Close()
			addr := strings.TrimPrefix(ts.URL, "http://")
			var mu sync.Mutex
			var recs []*recorder
			users := Users(NewPost(addr, "/v1/x", "Authorization: Bearer t"), 1000, func(dst []byte, user int) []byte {
				return fmt.Appendf(dst, `{"user":%d}`, user)
			})
			res, err := Run(context.Background(), Config{
				Addr: addr, Conns: 3, Duration: 600 * time.Millisecond, Rate: tc.rate,
				NewClient: func(conn int) Client {
					r := &recorder{Client: users(conn), seen: map[int]int{}}
					mu.Lock()
					recs = append(recs, r)
					mu.Unlock()
					return r
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			srv.mu.Lock()
			defer srv.mu.Unlock()
			if res.Errors != 0 || srv.bad != 0 {
				t.Fatalf("Run = %d errors (last %v), server saw %d bad requests; want none", res.Errors, res.LastErr, srv.bad)
			}
			if tc.want != 0 && res.Requests != tc.want {
				t.Errorf("Run(rate %v) = %d requests, want %d", tc.rate, res.Requests, tc.want)
			}
			if res.Requests < 14 || int(res.Requests) != srv.requests || res.Latency.Count() != res.Requests {
				t.Fatalf("Run = %d requests, %d latencies; server answered %d", res.Requests, res.Latency.Count(), srv.requests)
			}
			if wantLags := tc.want; res.Lag.Count() != wantLags {
				t.Errorf("Run(rate %v) = %d lags, want %d (one per request in an open loop)", tc.rate, res.Lag.Count(), wantLags)
			}
			seen := map[int]int{}
			for _, r := range recs {
				if r.wrong != 0 {
					t.Errorf("a connection saw %d answers not to its request", r.wrong)
				}
				for s, n := range r.seen {
					seen[s] += n
				}
			}
			for _, s := range []int{200, 429} {
				if uint64(srv.byStatus[s]) != res.Status[s] || seen[s] != srv.byStatus[s] {
					t.Errorf("status %d: Result %d, Client saw %d, server sent %d", s, res.Status[s], seen[s], srv.byStatus[s])
				}
			}
			if len(res.Status) != 2 {
				t.Errorf("Status = %v, want 200s and 429s only", res.Status)
			}
		})
	}
}

// In an open loop a stalled answer holds only its own connection: the
// server holds the first request until it has answered every other one,
// which the other connection can send only if it takes the requests due
// on the first one's turn too (with a schedule of its own per connection,
// the run ends with the held request's deadline and half the requests).
func TestOpenLoopStallHoldsOneConnection(t *testing.T) {
	const due = 40 // every 2 ms before 80 ms
	var (
		mu       sync.Mutex
		answered int
		held     bool
		release  = make(chan struct{})
	)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // so that the context ends when the client hangs up
		mu.Lock()
		first := !held
		held = true
		mu.Unlock()
		if first {
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		w.Write([]byte("{}"))
		mu.Lock()
		defer mu.Unlock()
		if answered++; answered == due-1 {
			close(release)
		}
	}))
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	res, err := Run(context.Background(), Config{
		Addr: addr, Conns: 2, Duration: 80 * time.Millisecond, Rate: 500, Timeout: time.Second,
		NewClient: Users(NewPost(addr, "/"), 1, func(dst []byte, _ int) []byte { return append(dst, "{}"...) }),
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests != due || res.Errors != 0 {
		t.Errorf("Run with one answer held = %d requests, %d errors (last %v); want %d, none", res.Requests, res.Errors, res.LastErr, due)
	}
}

// latencies is a Client that keeps the latency of each answer, in the
// order of its requests (with one connection, the schedule's).
type latencies struct {
	Client
	got []time.Duration
}

func (l *latencies) Response(_ int, _ []byte, lat time.Duration) { l.got = append(l.got, lat) }

// With one connection whose first answer the server holds, the requests
// due during the hold wait for the connection: each one's latency, counted
// from when it was due, is at least the hold less its due offset, and the
// first after the held one waited at least the hold less one interval for
// the connection. The bounds follow from the order of events, not from the
// host's speed.
func TestOpenLoopCountsTheWaitForAConnection(t *testing.T) {
	const (
		every = 2 * time.Millisecond // 500/s
		due   = 20                   // before 40 ms
		hold  = 30 * time.Millisecond
	)
	var (
		mu    sync.Mutex
		first = true
	)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		held := first
		first = false
		mu.Unlock()
		if held {
			time.Sleep(hold)
		}
		w.Write([]byte("{}"))
	}))
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	c := &latencies{Client: Users(NewPost(addr, "/"), 1, func(dst []byte, _ int) []byte { return append(dst, "{}"...) })(0)}
	res, err := Run(context.Background(), Config{
		Addr: addr, Conns: 1, Duration: due * every, Rate: float64(time.Second / every), Timeout: 10 * time.Second,
		NewClient: func(int) Client { return c },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests != due || res.Errors != 0 || len(c.got) != due {
		t.Fatalf("Run = %d requests (%d seen), %d errors (last %v); want %d, none", res.Requests, len(c.got), res.Errors, res.LastErr, due)
	}
	for k, lat := range c.got {
		if offset := time.Duration(k) * every; offset < hold && lat < hold-offset {
			t.Errorf("request %d (due at +%v) latency %v, want ≥ %v: counted from its due time, it includes the hold", k, offset, lat, hold-offset)
		}
	}
	if w := res.ConnWait.Max(); w < hold-every {
		t.Errorf("ConnWait.Max() = %v, want ≥ %v (request 1 waited for the held connection)", w, hold-every)
	}
	if res.ConnWait.Count() != res.Requests || res.Lag.Count() != res.Requests {
		t.Errorf("ConnWait, Lag count %d, %d; want one per request, %d", res.ConnWait.Count(), res.Lag.Count(), res.Requests)
	}
	if res.Lag.Max() <= 0 {
		t.Errorf("Lag.Max() = %v, want > 0 (a request is written after it is due or taken)", res.Lag.Max())
	}
}

// Once the connections' deadline (Duration + Timeout) has passed, an open
// loop counts the requests still due as errors without dialling for them:
// the server holds one answer past the deadline, and sees one connection.
func TestOpenLoopPastTheDeadline(t *testing.T) {
	const due = 20 // every 5 ms before 100 ms
	var (
		mu       sync.Mutex
		requests int
		conns    atomic.Int64
	)
	ts := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // so that the context ends when the client hangs up
		mu.Lock()
		requests++
		held := requests == 5
		mu.Unlock()
		if held {
			<-r.Context().Done()
			return
		}
		w.Write([]byte("{}"))
	}))
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	ts.Start()
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	res, _ := Run(context.Background(), Config{ // no answer at all is an error, on a host slow enough
		Addr: addr, Conns: 1, Duration: 100 * time.Millisecond, Rate: 200, Timeout: 100 * time.Millisecond,
		NewClient: Users(NewPost(addr, "/"), 1, func(dst []byte, _ int) []byte { return append(dst, "{}"...) }),
	})
	if res.Requests+res.Errors != due || res.Requests >= due {
		t.Errorf("Run = %d requests, %d errors; want %d in all, some failed", res.Requests, res.Errors, due)
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("server saw %d connections, want 1", n)
	}
	if res.Lag.Count() != res.Requests || res.ConnWait.Count() != res.Requests {
		t.Errorf("Lag, ConnWait count %d, %d; want one per answered request, %d", res.Lag.Count(), res.ConnWait.Count(), res.Requests)
	}
}

func TestRunRefusesChunkedAndCountsErrors(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("a"))
		w.(http.Flusher).Flush() // no Content-Length: chunked
	}))
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	res, err := Run(context.Background(), Config{
		Addr: addr, Conns: 1, Duration: 100 * time.Millisecond,
		NewClient: Users(NewPost(addr, "/"), 1, func(dst []byte, _ int) []byte { return append(dst, "{}"...) }),
	})
	if err == nil || res.Requests != 0 || res.Errors == 0 {
		t.Fatalf("Run against a chunked server = %d requests, %d errors, %v; want an error and no request", res.Requests, res.Errors, err)
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	for _, c := range []Config{{}, {Addr: "x:1", Conns: 1, Duration: time.Second}, {Addr: "x:1", Conns: 1, Duration: time.Second, Rate: -1, NewClient: func(int) Client { return nil }}} {
		if _, err := Run(context.Background(), c); err == nil {
			t.Errorf("Run(%+v) = nil error, want one", c)
		}
	}
}

func TestHistogramBuckets(t *testing.T) {
	for v := uint64(0); v < 1<<20; v += 1 + v/97 {
		checkBucket(t, v)
	}
	for _, v := range []uint64{1<<40 - 1, 1 << 40, 1<<62 + 12345, 1<<63 - 1} {
		checkBucket(t, v)
	}
}

func checkBucket(t *testing.T, v uint64) {
	t.Helper()
	i := bucket(v)
	if i < 0 || i >= buckets || lowest(i) > v || (i+1 < buckets && lowest(i+1) <= v) {
		t.Fatalf("bucket(%d) = %d holding [%d, %d)", v, i, lowest(i), lowest(i+1))
	}
	if w := lowest(i+1) - lowest(i); v >= 1<<subBits && w > v>>subBits {
		t.Fatalf("bucket(%d) is %d wide, more than 1/%d of it", v, w, 1<<subBits)
	}
}

func TestHistogramQuantile(t *testing.T) {
	var h, o Histogram
	for i := 1; i <= 900; i++ {
		h.Record(time.Duration(i) * time.Microsecond)
	}
	for i := 1; i <= 100; i++ {
		o.Record(time.Duration(i) * time.Millisecond)
	}
	o.Record(-time.Second) // counts as 0
	h.Merge(&o)
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{
		// sorted: 0, 1…900 µs, 1…100 ms; the rank is ⌊q·1001⌋
		{0.5, 499 * time.Microsecond},
		{0.9, 899 * time.Microsecond},
		{0.99, 89 * time.Millisecond},
		{1, 100 * time.Millisecond},
	} {
		got := h.Quantile(tc.q)
		if got < tc.want || got > tc.want+tc.want/(1<<subBits) {
			t.Errorf("Quantile(%v) = %v, want %v (+1/%d)", tc.q, got, tc.want, 1<<subBits)
		}
	}
	if h.Count() != 1001 || h.Max() != 100*time.Millisecond {
		t.Errorf("Count, Max = %d, %v; want 1001, 100ms", h.Count(), h.Max())
	}
	var empty Histogram
	if empty.Quantile(0.99) != 0 {
		t.Errorf("empty Quantile = %v, want 0", empty.Quantile(0.99))
	}
}

// stepper is a Sequencer whose requests come in sequences of three
// steps, each naming its step in the path.
type stepper struct {
	post [3]Post
	step int
}

func (s *stepper) Next(buf []byte) []byte { return s.post[s.step].Append(buf, []byte("{}")) }

func (s *stepper) Response(int, []byte, time.Duration) { s.step = (s.step + 1) % 3 }

func (s *stepper) InSequence() bool { return s.step != 0 }

// TestSequencer checks that a closed loop reaching its end lets every
// connection finish the sequence it began: the server sees as many last
// steps as first ones. The first step is slow, so the end nearly always
// falls inside a sequence.
func TestSequencer(t *testing.T) {
	var mu sync.Mutex
	steps := map[string]int{}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/0" {
			time.Sleep(5 * time.Millisecond)
		}
		mu.Lock()
		steps[r.URL.Path]++
		mu.Unlock()
	}))
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	res, err := Run(context.Background(), Config{
		Addr: addr, Conns: 3, Duration: 100 * time.Millisecond,
		NewClient: func(int) Client {
			return &stepper{post: [3]Post{NewPost(addr, "/0"), NewPost(addr, "/1"), NewPost(addr, "/2")}}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if res.Errors != 0 || steps["/0"] == 0 || steps["/0"] != steps["/1"] || steps["/1"] != steps["/2"] ||
		res.Requests != uint64(steps["/0"]+steps["/1"]+steps["/2"]) {
		t.Errorf("Run = %d requests, %d errors; server saw steps %v, want as many of each", res.Requests, res.Errors, steps)
	}
}

func TestInts(t *testing.T) {
	got, err := Ints(" 16, 64", 1)
	if err != nil || !slices.Equal(got, []int{16, 64}) {
		t.Fatalf("Ints(\" 16, 64\", 1) = %v, %v; want [16 64]", got, err)
	}
	if got, err := Ints("0,5", 0); err != nil || !slices.Equal(got, []int{0, 5}) {
		t.Fatalf("Ints(\"0,5\", 0) = %v, %v; want [0 5]", got, err)
	}
	for _, bad := range []string{"0", "16,", "x", "16;64", "-1"} {
		if got, err := Ints(bad, 1); err == nil {
			t.Errorf("Ints(%q, 1) = %v, want an error", bad, got)
		}
	}
}
