// Package llmtest is a stand-in LLM for the gateway's tests, benchmarks and
// the demo: an HTTP server speaking the OpenAI wire format (chat
// completions, streamed or not, and embeddings) whose answers and usage the
// test sets, so that what the gateway charges can be compared with what the
// upstream reported. It is a fake model, not a mock of quotaflow's servers.
package llmtest

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// Upstream is the stand-in server. Set its Behaviour with Set; read what it
// saw with Requests.
type Upstream struct {
	// URL is the base URL to configure, ending in /v1.
	URL string
	// Canceled is closed when a stalled stream's request was canceled.
	Canceled chan struct{}

	srv  *httptest.Server
	mu   sync.Mutex
	b    Behaviour
	seen []Request
}

// Behaviour is how the upstream answers.
type Behaviour struct {
	// Words are the streamed text's pieces, one chunk each (default five
	// " hello", one token each in the GPT encodings).
	Words []string
	// PromptTokens and CompletionTokens are the usage it reports (default
	// 11 and 5).
	PromptTokens, CompletionTokens int64
	// Status, when not 0 or 200, is answered before any token with an
	// OpenAI error body.
	Status int
	// CutAfter, when > 0, ends a stream after that many words without
	// usage: the connection is dropped (an upstream failing midway).
	CutAfter int
	// StallAfter, when > 0, stops a stream after that many words until the
	// client's request is canceled, which it then reports on Canceled.
	StallAfter int
	// Hold, when set, delays every answer until it is closed (after
	// Arrived is told).
	Hold chan struct{}
	// Arrived, when set, is sent a value as each request arrives.
	Arrived chan struct{}
}

// Set makes b the upstream's behaviour for the requests that arrive next.
func (u *Upstream) Set(b Behaviour) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.b = b
}

// Request is what the upstream received.
type Request struct {
	Path          string
	Authorization string
	Body          map[string]any
}

// Start starts the server until the test ends.
func Start(t testing.TB) *Upstream {
	u := New()
	t.Cleanup(u.Close)
	return u
}

// New starts the server on a loopback port (the demo's); Close stops it.
func New() *Upstream {
	u := &Upstream{b: Behaviour{PromptTokens: 11, CompletionTokens: 5}, Canceled: make(chan struct{})}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	u.URL = u.srv.URL + "/v1"
	return u
}

// Close stops the server.
func (u *Upstream) Close() { u.srv.Close() }

// Requests returns what the upstream received so far.
func (u *Upstream) Requests() []Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]Request(nil), u.seen...)
}

func (b *Behaviour) words() []string {
	if b.Words != nil {
		return b.Words
	}
	return []string{" hello", " hello", " hello", " hello", " hello"}
}

func (u *Upstream) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	u.mu.Lock()
	u.seen = append(u.seen, Request{Path: r.URL.Path, Authorization: r.Header.Get("Authorization"), Body: body})
	b := u.b
	u.mu.Unlock()
	if b.Arrived != nil {
		b.Arrived <- struct{}{}
	}
	if b.Hold != nil {
		<-b.Hold
	}
	if b.Status != 0 && b.Status != http.StatusOK {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(b.Status)
		fmt.Fprintf(w, `{"error":{"message":"stand-in failure","type":"server_error","param":null,"code":null}}`)
		return
	}
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`,
		b.PromptTokens, b.CompletionTokens, b.PromptTokens+b.CompletionTokens)
	switch r.URL.Path {
	case "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"object":"list","data":[{"id":"gpt-4o","object":"model"}]}`)
	case "/v1/embeddings":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":%d,"total_tokens":%d}}`,
			b.PromptTokens, b.PromptTokens)
	case "/v1/chat/completions":
		if stream, _ := body["stream"].(bool); stream {
			u.stream(w, r, &b, body, usage)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		text, _ := json.Marshal(strings.Join(b.words(), ""))
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":%s},"finish_reason":"stop"}],"usage":%s}`,
			text, usage)
	default:
		http.NotFound(w, r)
	}
}

// stream answers a chat completion as server-sent events, one chunk per
// word, flushed; the usage chunk only when the request asked for it.
func (u *Upstream) stream(w http.ResponseWriter, r *http.Request, b *Behaviour, body map[string]any, usage string) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	send := func(data string) {
		fmt.Fprintf(w, "data: %s\n\n", data)
		_ = rc.Flush()
	}
	send(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`)
	for i, word := range b.words() {
		if b.CutAfter > 0 && i == b.CutAfter {
			panic(http.ErrAbortHandler) // drops the connection mid-stream
		}
		if b.StallAfter > 0 && i == b.StallAfter {
			<-r.Context().Done()
			close(u.Canceled)
			return
		}
		text, _ := json.Marshal(word)
		send(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"content":` + string(text) + `},"finish_reason":null}]}`)
	}
	send(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
	if so, _ := body["stream_options"].(map[string]any); so["include_usage"] == true {
		send(UsageChunk(usage))
	}
	send("[DONE]")
}

// UsageChunk is the data of the usage-only chunk for usage (a JSON object).
func UsageChunk(usage string) string {
	return `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[],"usage":` + usage + `}`
}
