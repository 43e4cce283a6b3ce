package llmproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
)

// fakeAdmitter admits everything and records how each request settled.
type fakeAdmitter struct {
	mu       sync.Mutex
	admitted int
	released []string
	actual   []events.Actual
}

func (a *fakeAdmitter) AdmitTokens(context.Context, decide.Input, int64, int64) httpapi.Admission {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.admitted++
	return httpapi.Admission{Status: http.StatusOK, RequestID: fmt.Sprintf("r%d", a.admitted)}
}

func (a *fakeAdmitter) Release(_ context.Context, _, _, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.released = append(a.released, id)
	return nil
}

func (a *fakeAdmitter) ReportActual(_ context.Context, ev events.Actual) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.actual = append(a.actual, ev)
	return nil
}

// testKey is acme/alice's, otherKey another tenant's: globex/bob.
const testKey, otherKey = "sk-test", "sk-other"

// gateway is a Proxy in front of upstream, with testKey and otherKey.
type gateway struct {
	t   *testing.T
	px  *Proxy
	adm *fakeAdmitter
	url string
}

func newGateway(t *testing.T, upstream http.Handler, o Options) *gateway {
	t.Helper()
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	cfg, err := Build(Settings{GatewayUpstream: up.URL + "/v1", GatewayKeys: []string{testKey + "=acme/alice", otherKey + "=globex/bob"}}, nil, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	g := &gateway{t: t, adm: &fakeAdmitter{}}
	o.Config, o.Admitter = func() *Config { return cfg }, g.adm
	if g.px, err = New(o); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.px)
	t.Cleanup(srv.Close)
	g.url = srv.URL
	return g
}

// post sends body to path with testKey and returns the answer, which the
// caller closes.
func (g *gateway) post(path, body string) *http.Response {
	g.t.Helper()
	return g.postAs(testKey, path, body)
}

// postAs is post with key.
func (g *gateway) postAs(key, path, body string) *http.Response {
	g.t.Helper()
	req, _ := http.NewRequest("POST", g.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		g.t.Fatal(err)
	}
	return resp
}

// settled waits until every request settled and returns the charges and
// releases.
func (g *gateway) settled() ([]events.Actual, []string) {
	g.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := g.px.Close(ctx); err != nil {
		g.t.Fatal(err)
	}
	return g.adm.actual, g.adm.released
}

// holdUsage streams chunks, then holds its usage chunk back until the
// client is gone, as a model still generating does.
func holdUsage(chunks ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range chunks {
			fmt.Fprintf(w, "data: %s\n\n", c)
			w.(http.Flusher).Flush()
		}
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second): // the proxy never canceled: the test fails on what it charged
			fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n")
		}
	}
}

// TestFunctionCallStreamIsCharged: a streamed legacy function call (chat's
// "functions"), received whole by a client that leaves before the usage
// chunk, is charged its input and the call's tokens, not released.
func TestFunctionCallStreamIsCharged(t *testing.T) {
	g := newGateway(t, holdUsage(
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"function_call":{"name":"lookup","arguments":""}}}]}`,
		`{"choices":[{"index":0,"delta":{"function_call":{"arguments":"{\"city\": \"Paris\"}"}}}]}`,
		`{"choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}`,
	), Options{})
	resp := g.post("/v1/chat/completions", `{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"Weather in Paris?"}],`+
		`"functions":[{"name":"lookup","parameters":{"type":"object"}}],"function_call":{"name":"lookup"}}`)
	sc := bufio.NewScanner(resp.Body)
	for n := 0; n < 3 && sc.Scan(); {
		if strings.HasPrefix(sc.Text(), "data: ") {
			n++
		}
	}
	resp.Body.Close() // leaves
	actual, released := g.settled()
	if len(released) != 0 || len(actual) != 1 || actual[0].OutputTokens == 0 {
		t.Errorf("actual %+v, released %v: want the function call charged", actual, released)
	}
}

// TestLongResponsesEventIsChargedItsUsage: a /v1/responses stream whose
// response.completed is over a MiB (it echoes the caller's instructions)
// is charged the usage the upstream reported in it, not the estimate's
// input and the streamed text.
func TestLongResponsesEventIsChargedItsUsage(t *testing.T) {
	instructions, _ := json.Marshal(strings.Repeat(" ", 1<<20))
	g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"42\"}\n\n")
		fmt.Fprintf(w, "data: {\"type\":\"response.completed\",\"response\":{\"instructions\":%s,\"usage\":{\"input_tokens\":200000,\"output_tokens\":30000}}}\n\n", instructions)
	}), Options{})
	resp := g.post("/v1/responses", `{"model":"o3","stream":true,"instructions":`+string(instructions)+`,"input":"What is 6 × 7?"}`)
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	actual, released := g.settled()
	if len(actual) != 1 || actual[0].InputTokens != 200000 || actual[0].OutputTokens != 30000 {
		t.Errorf("actual %+v, released %v: want 200000 in, 30000 out as reported", actual, released)
	}
}

// TestLongDeltaOfACutStreamIsCharged: a stream cut before its usage whose
// one delta is a 2 MiB line (a tool call's arguments the caller had the
// model write), which passes through unread, is charged its text at a
// token per 3 bytes at least, not released as if nothing came.
func TestLongDeltaOfACutStreamIsCharged(t *testing.T) {
	const n = 2 << 20
	text := strings.Repeat("x", n)
	for _, c := range []struct{ path, body, event string }{
		{"/v1/chat/completions", `{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"go"}]}`,
			`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"` + text + `"}}]}}]}`},
		{"/v1/responses", `{"model":"gpt-4o","stream":true,"input":"go"}`,
			`{"type":"response.function_call_arguments.delta","output_index":0,"delta":"` + text + `"}`},
	} {
		t.Run(c.path, func(t *testing.T) {
			g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprintf(w, "data: %s\n\n", c.event) // then the upstream fails
			}), Options{})
			resp := g.post(c.path, c.body)
			if _, err := io.Copy(io.Discard, resp.Body); err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			actual, released := g.settled()
			if len(actual) != 1 || actual[0].OutputTokens < n/3 {
				t.Errorf("actual %+v, released %v: want %d output tokens or more", actual, released, n/3)
			}
		})
	}
}

// TestUnreadAnswerLeavesOtherTenantsTheirUsage: a client that does not read
// its large non-stream answer holds only its tenant's share of the buffer
// budget, so another tenant's answer is still read whole and charged the
// usage its upstream reported, not its estimate (input + max_tokens).
func TestUnreadAnswerLeavesOtherTenantsTheirUsage(t *testing.T) {
	large := `{"object":"list","data":[{"embedding":"` + strings.Repeat("A", 16<<20) + `"}],"usage":{"prompt_tokens":1,"total_tokens":1}}`
	// Over one 32 KiB read: no remainder of the budget holds it by chance.
	reply := `{"choices":[{"index":0,"message":{"role":"assistant","content":"` + strings.Repeat("hi ", 40<<10) + `"}}],"usage":{"prompt_tokens":10,"completion_tokens":2}}`
	g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if strings.HasSuffix(r.URL.Path, "/embeddings") {
			io.WriteString(w, large)
			return
		}
		io.WriteString(w, reply)
	}), Options{BufferBudget: 4 << 20})
	conn, err := net.Dial("tcp", strings.TrimPrefix(g.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetReadBuffer(4 << 10)
	body := `{"model":"text-embedding-3-small","input":"a"}`
	fmt.Fprintf(conn, "POST /v1/embeddings HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s", testKey, len(body), body)
	// Its status line comes after its answer took the budget it holds; the
	// client reads no further.
	if line, err := bufio.NewReader(conn).ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
		t.Fatalf("status line %q, %v", line, err)
	}
	resp := g.postAs(otherKey, "/v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`)
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	conn.Close()
	actual, _ := g.settled()
	var other []events.Actual
	for _, a := range actual {
		if a.Tenant == "globex" {
			other = append(other, a)
		}
	}
	if len(other) != 1 || other[0].InputTokens != 10 || other[0].OutputTokens != 2 {
		t.Errorf("globex charged %+v, want the 10 in / 2 out its upstream reported", other)
	}
}

// TestBodiesBeingReadAreBounded: the request bodies being read take memory
// before they are read, a tenant's at most half the budget: a key's holder
// that keeps large bodies coming slowly gets 503 with Retry-After past its
// share, and another tenant's request still goes through.
func TestBodiesBeingReadAreBounded(t *testing.T) {
	answer := `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`
	g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, answer) }),
		Options{InspectBudget: 2 * inspectCost << 20})
	body := `{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}`
	// acme's slow body declares 1 MiB, its share, and sends 64 KiB of it
	// (past the client's buffer, so the request goes out), then waits.
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.CloseWithError(io.ErrUnexpectedEOF) }) // a failed check must not leave the server waiting for it
	go pw.Write([]byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat(" ", 64<<10)))
	slow, _ := http.NewRequest("POST", g.url+"/v1/chat/completions", pr)
	slow.ContentLength = 1 << 20
	slow.Header.Set("Authorization", "Bearer "+testKey)
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(slow)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	// Polling decides when to look, not what is asserted: once the slow
	// body's memory is taken, acme's next request is refused.
	for deadline := time.Now().Add(10 * time.Second); g.px.bodies.heldBy("acme") == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the slow body's memory was never taken")
		}
	}
	refused := g.post("/v1/chat/completions", body)
	refused.Body.Close()
	if refused.StatusCode != http.StatusServiceUnavailable || refused.Header.Get("Retry-After") == "" {
		t.Errorf("acme's request while its share is taken by a body being read: %d, Retry-After %q; want 503 with Retry-After",
			refused.StatusCode, refused.Header.Get("Retry-After"))
	}
	resp := g.postAs(otherKey, "/v1/chat/completions", body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("globex's request while acme's body is read: %d, want 200", resp.StatusCode)
	}
	pw.CloseWithError(io.ErrUnexpectedEOF) // acme's body ends short: its memory is given back
	<-done
	for deadline := time.Now().Add(10 * time.Second); g.px.bodies.heldBy("acme") != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the memory of a body that ended short was never given back")
		}
	}
	resp = g.post("/v1/chat/completions", body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("acme's request once its slow body ended: %d, want 200", resp.StatusCode)
	}
}

// TestSentBodyIsLetGoOnceAnswered: the copy of a body sent upstream is
// held, and counted in the inspect budget, until the upstream read it and
// answered; then nothing keeps it, however long the answer streams. While
// acme's first request waits for its answer, a second body past acme's
// share is refused; once it streams, acme's other requests go through,
// and with all their streams open the bodies' memory is free.
func TestSentBodyIsLetGoOnceAnswered(t *testing.T) {
	const size, streams = 4 << 20, 4
	body := `{"model":"local","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", size) + `"}]}`
	var calls atomic.Int32
	got, answer := make(chan struct{}), make(chan struct{})
	g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // read whole before answering, as servers do
		if calls.Add(1) == 1 {
			close(got)
			<-answer
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done() // streams until the client leaves
	}), Options{InspectBudget: 2 * inspectCost * int64(len(body))}) // acme's share: one body being read
	before := liveHeap()
	first := make(chan *http.Response, 1)
	go func() { first <- g.post("/v1/chat/completions", body) }()
	select {
	case <-got:
	case resp := <-first:
		t.Fatalf("acme's first request answered %d before its upstream had it", resp.StatusCode)
	}
	if held := g.px.bodies.heldBy("acme"); held < size {
		t.Errorf("acme holds %d bytes of the budget while the upstream has not answered, want its body's %d", held, size)
	}
	refused := g.post("/v1/chat/completions", body)
	refused.Body.Close()
	if refused.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("acme's second body while the first awaits its answer: %d, want 503", refused.StatusCode)
	}
	close(answer)
	open := []*http.Response{<-first}
	for len(open) < streams {
		open = append(open, g.post("/v1/chat/completions", body))
	}
	for i, resp := range open {
		if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
			t.Fatalf("stream %d: status %d, first line %q, %v", i, resp.StatusCode, line, err)
		}
		defer resp.Body.Close()
	}
	if held := g.px.bodies.heldBy("acme"); held != 0 {
		t.Errorf("acme holds %d bytes of the budget with its %d streams answered, want 0", held, streams)
	}
	if grown := int64(liveHeap()) - int64(before); grown > size {
		t.Errorf("the live heap grew %d bytes with %d streams of %d-byte bodies open, want their bodies let go", grown, streams, size)
	}
}

// TestPassedBodyIsBounded: a passed-through body is held in memory as an
// inspected one is, so it counts in the same budget under its tenant's
// share: one past the share is refused with 503 and Retry-After before it
// reaches the upstream; one within it is held until the upstream read it
// and answered, then given back.
func TestPassedBodyIsBounded(t *testing.T) {
	const budget = 2 << 20 // acme's share: 1 MiB
	var calls atomic.Int32
	got, answer := make(chan int, 1), make(chan struct{})
	g := newGateway(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		n, _ := io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/v1/files/held" { // answered once the test looked
			got <- int(n)
			<-answer
		}
		fmt.Fprint(w, `{"object":"file"}`)
	}), Options{InspectBudget: budget})
	g.px.cfg().pass = []string{"/v1/files*"}

	refused := g.post("/v1/files", strings.Repeat("x", 3<<19)) // 1.5 MiB
	refused.Body.Close()
	if refused.StatusCode != http.StatusServiceUnavailable || refused.Header.Get("Retry-After") == "" {
		t.Errorf("a passed body past acme's share: %d, Retry-After %q; want 503 with Retry-After",
			refused.StatusCode, refused.Header.Get("Retry-After"))
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("the upstream had %d refused bodies, want none", n)
	}

	const size = 1 << 19
	first := make(chan *http.Response, 1)
	go func() { first <- g.post("/v1/files/held", strings.Repeat("x", size)) }()
	if n := <-got; n != size {
		t.Errorf("the upstream read %d bytes, want %d", n, size)
	}
	if held := g.px.bodies.heldBy("acme"); held != size {
		t.Errorf("acme holds %d bytes of the budget while the upstream has not answered, want its body's %d", held, size)
	}
	close(answer)
	resp := <-first
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a passed body within acme's share: %d, want 200", resp.StatusCode)
	}
	// Polling decides when to look: the handler may still be returning.
	for deadline := time.Now().Add(10 * time.Second); g.px.bodies.heldBy("acme") != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the memory of a passed body was never given back")
		}
	}
	g.px.bodies.mu.Lock()
	left := g.px.bodies.left
	g.px.bodies.mu.Unlock()
	if left != budget {
		t.Errorf("the budget has %d bytes left once the answer was sent, want all %d", left, budget)
	}
}

// TestSentBodyRetries: until dropped, a sent body gives the transport a new
// reader for each retry (GetBody), each the whole body; its budget is
// given back once it is dropped and every reader ended, read to its end or
// closed, whatever the order.
func TestSentBodyRetries(t *testing.T) {
	freed := 0
	s := newSentBody([]byte("{}"), func() { freed++ })
	first, _ := s.reader()
	if b, err := io.ReadAll(first); string(b) != "{}" || err != nil {
		t.Fatalf("first reader: %q, %v", b, err)
	}
	retry, err := s.reader() // the connection failed: the transport rewinds
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(retry); string(b) != "{}" || err != nil {
		t.Fatalf("retry's reader: %q, %v", b, err)
	}
	unread, _ := s.reader()
	s.drop()
	if _, err := s.reader(); err == nil {
		t.Error("a reader after the body was dropped")
	}
	if freed != 0 {
		t.Fatal("the budget was given back while a reader still held the body")
	}
	unread.Close()
	first.Close()
	s.drop()
	if freed != 1 {
		t.Errorf("the budget was given back %d times, want once", freed)
	}
}

// liveHeap is the heap's live bytes after a collection.
func liveHeap() uint64 {
	runtime.GC()
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// heldBy is what tenant holds of b.
func (b *budget) heldBy(tenant string) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held[tenant]
}
