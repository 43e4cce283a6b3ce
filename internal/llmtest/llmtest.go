// Package llmtest is a stand-in LLM for the gateway's tests, benchmarks and
// the demo: an HTTP server speaking the OpenAI wire format (chat
// completions, streamed or not, and embeddings) whose answers and usage the
// test sets, so that what the gateway charges can be compared with what the
// upstream reported. It speaks chat completions, completions and responses,
// streamed or not, and embeddings. It is a fake model, not a mock of quotaflow's servers.
package llmtest

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Upstream is the stand-in server. Set its Behaviour with Set; read what it
// saw with Requests.
type Upstream struct {
	// URL is the base URL to configure, ending in /v1.
	URL string
	// Canceled is closed when a stalled stream's request was canceled.
	Canceled chan struct{}

	srv     *httptest.Server
	written atomic.Int64 // streamed words written and flushed
	mu      sync.Mutex
	b       Behaviour
	seen    []Request
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

// Written is how many words the upstream's streams have written so far,
// each flushed to the connection: a word that the connection cannot take
// (the reader stopped reading) blocks the stream before it is counted.
func (u *Upstream) Written() int64 { return u.written.Load() }

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
	stream, _ := body["stream"].(bool)
	var text []byte
	if !stream || r.URL.Path == "/v1/responses" { // a long stream is never joined
		text, _ = json.Marshal(strings.Join(b.words(), ""))
	}
	w.Header().Set("Content-Type", "application/json")
	switch r.URL.Path {
	case "/v1/models":
		fmt.Fprint(w, `{"object":"list","data":[{"id":"gpt-4o","object":"model"}]}`)
	case "/v1/embeddings":
		fmt.Fprintf(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":%d,"total_tokens":%d}}`,
			b.PromptTokens, b.PromptTokens)
	case "/v1/chat/completions":
		if stream {
			u.stream(w, r, &b, chatStream(body, usage))
			return
		}
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":%s},"finish_reason":"stop"}],"usage":%s}`,
			text, usage)
	case "/v1/completions":
		if stream {
			u.stream(w, r, &b, completionsStream(body, usage))
			return
		}
		fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","created":1,"model":"gpt-3.5-turbo-instruct","choices":[{"index":0,"text":%s,"logprobs":null,"finish_reason":"stop"}],"usage":%s}`,
			text, usage)
	case "/v1/responses":
		done := response("completed", string(text), ResponsesUsage(b.PromptTokens, b.CompletionTokens))
		if stream {
			u.stream(w, r, &b, responsesStream(done))
			return
		}
		fmt.Fprint(w, done)
	default:
		w.Header().Del("Content-Type")
		http.NotFound(w, r)
	}
}

// format is how one endpoint streams: the events before the words, one
// word's event, and the events after them (each an SSE event less its
// blank line).
type format struct {
	head []string
	word func(string) string
	tail []string
}

// stream answers as server-sent events, one event per word, each flushed.
func (u *Upstream) stream(w http.ResponseWriter, r *http.Request, b *Behaviour, f format) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	send := func(event string) {
		fmt.Fprintf(w, "%s\n\n", event)
		_ = rc.Flush()
	}
	for _, e := range f.head {
		send(e)
	}
	for i, word := range b.words() {
		if b.CutAfter > 0 && i == b.CutAfter {
			panic(http.ErrAbortHandler) // drops the connection mid-stream
		}
		if b.StallAfter > 0 && i == b.StallAfter {
			<-r.Context().Done()
			close(u.Canceled)
			return
		}
		send(f.word(word))
		u.written.Add(1)
	}
	for _, e := range f.tail {
		send(e)
	}
}

// includeUsage is whether a chat or completions request asked for the
// usage chunk.
func includeUsage(body map[string]any) bool {
	so, _ := body["stream_options"].(map[string]any)
	return so["include_usage"] == true
}

func chatStream(body map[string]any, usage string) format {
	f := format{
		head: []string{`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`},
		word: func(word string) string {
			text, _ := json.Marshal(word)
			return `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"content":` + string(text) + `},"finish_reason":null}]}`
		},
		tail: []string{`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`},
	}
	if includeUsage(body) {
		f.tail = append(f.tail, "data: "+UsageChunk(usage))
	}
	f.tail = append(f.tail, "data: [DONE]")
	return f
}

func completionsStream(body map[string]any, usage string) format {
	chunk := func(text, finish string) string {
		return `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"gpt-3.5-turbo-instruct","choices":[{"index":0,"text":` + text + `,"logprobs":null,"finish_reason":` + finish + `}]}`
	}
	f := format{
		word: func(word string) string {
			text, _ := json.Marshal(word)
			return chunk(string(text), "null")
		},
		tail: []string{chunk(`""`, `"stop"`)},
	}
	if includeUsage(body) {
		f.tail = append(f.tail, "data: "+CompletionsUsageChunk(usage))
	}
	f.tail = append(f.tail, "data: [DONE]")
	return f
}

// responsesStream is a responses stream: its usage comes only in
// response.completed, which repeats the whole response; there is no [DONE].
func responsesStream(done string) format {
	event := func(typ, data string) string { return "event: " + typ + "\ndata: " + data }
	return format{
		head: []string{event("response.created", `{"type":"response.created","response":`+response("in_progress", "", "null")+`}`)},
		word: func(word string) string {
			text, _ := json.Marshal(word)
			return event("response.output_text.delta", `{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":`+string(text)+`}`)
		},
		tail: []string{event("response.completed", `{"type":"response.completed","response":`+done+`}`)},
	}
}

// response is a responses object of status whose output is text (a JSON
// string, none when empty) and usage (a JSON value).
func response(status, text, usage string) string {
	output := "[]"
	if text != "" {
		output = `[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":` + text + `,"annotations":[]}]}]`
	}
	return `{"id":"resp_1","object":"response","created_at":1,"status":"` + status + `","model":"gpt-4o","output":` + output + `,"usage":` + usage + `}`
}

// UsageChunk is the data of a chat stream's usage-only chunk for usage (a
// JSON object).
func UsageChunk(usage string) string {
	return `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[],"usage":` + usage + `}`
}

// CompletionsUsageChunk is the data of a completions stream's usage-only
// chunk for usage (a JSON object).
func CompletionsUsageChunk(usage string) string {
	return `{"id":"cmpl-1","object":"text_completion","created":1,"model":"gpt-3.5-turbo-instruct","choices":[],"usage":` + usage + `}`
}

// ResponsesUsage is a responses usage object of input and output tokens.
func ResponsesUsage(input, output int64) string {
	return fmt.Sprintf(`{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}`,
		input, output, input+output)
}
