package llmproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
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

const testKey = "sk-test"

// gateway is a Proxy in front of upstream, with testKey for acme/alice.
type gateway struct {
	t   *testing.T
	px  *Proxy
	adm *fakeAdmitter
	url string
}

func newGateway(t *testing.T, upstream http.Handler) *gateway {
	t.Helper()
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	cfg, err := Build(Settings{GatewayUpstream: up.URL + "/v1", GatewayKeys: []string{testKey + "=acme/alice"}}, nil, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	g := &gateway{t: t, adm: &fakeAdmitter{}}
	if g.px, err = New(Options{Config: func() *Config { return cfg }, Admitter: g.adm}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.px)
	t.Cleanup(srv.Close)
	g.url = srv.URL
	return g
}

// post sends body to path and returns the answer, which the caller closes.
func (g *gateway) post(path, body string) *http.Response {
	g.t.Helper()
	req, _ := http.NewRequest("POST", g.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+testKey)
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
	))
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
	}))
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
