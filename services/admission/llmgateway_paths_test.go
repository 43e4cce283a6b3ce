package main

import (
	"bufio"
	"fmt"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/llmtest"
	"quotaflow/services/admission/internal/openai"
)

// The gateway's other metered endpoints end to end (completions and
// responses, streamed and not), and a slow client's back-pressure.

// TestGatewayCompletionsAndResponses: /v1/completions and /v1/responses,
// streamed and not, reach the client whole (a completions stream less the
// usage chunk the client did not ask for; a responses stream untouched) and
// are charged exactly the usage the stand-in reported: a responses stream's
// read from its response.completed event.
func TestGatewayCompletionsAndResponses(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	completions := func(stream, includeUsage bool) string {
		b := fmt.Sprintf(`{"model":"gpt-3.5-turbo-instruct","prompt":"Say hello five times.","max_tokens":20,"stream":%v`, stream)
		if includeUsage {
			b += `,"stream_options":{"include_usage":true}`
		}
		return b + "}"
	}
	responses := func(stream bool) string {
		return fmt.Sprintf(`{"model":"gpt-4o","input":"Say hello five times.","max_output_tokens":30,"stream":%v}`, stream)
	}
	const text = " hello hello hello hello hello"
	cases := []struct {
		name, path, body string
		in, out          int64
		check            func(t *testing.T, raw string)
	}{
		{"completions", "/v1/completions", completions(false, false), 31, 4, func(t *testing.T, raw string) {
			if u, ok := openai.UsageOf(openai.Completions, []byte(raw)); !ok || u != (openai.Usage{Input: 31, Output: 4}) || !strings.Contains(raw, `"text":"`+text+`"`) {
				t.Errorf("answer = %s, want the text and usage 31/4", raw)
			}
		}},
		{"completions stream", "/v1/completions", completions(true, false), 32, 5, func(t *testing.T, raw string) {
			data := sse(t, strings.NewReader(raw))
			if len(data) != 5+1+1 || data[len(data)-1] != "[DONE]" || strings.Contains(raw, `"usage"`) {
				t.Errorf("stream = %v, want five words, the finish chunk and [DONE], no usage chunk", data)
			}
		}},
		{"completions stream with usage", "/v1/completions", completions(true, true), 33, 6, func(t *testing.T, raw string) {
			usage := llmtest.CompletionsUsageChunk(`{"prompt_tokens":33,"completion_tokens":6,"total_tokens":39}`)
			if data := sse(t, strings.NewReader(raw)); len(data) != 5+1+1+1 || data[len(data)-2] != usage {
				t.Errorf("stream = %v, want the usage chunk the client asked for before [DONE]", data)
			}
		}},
		{"responses", "/v1/responses", responses(false), 34, 7, func(t *testing.T, raw string) {
			if u, ok := openai.UsageOf(openai.Responses, []byte(raw)); !ok || u != (openai.Usage{Input: 34, Output: 7}) || !strings.Contains(raw, `"text":"`+text+`"`) {
				t.Errorf("answer = %s, want the text and usage 34/7", raw)
			}
		}},
		{"responses stream", "/v1/responses", responses(true), 35, 8, func(t *testing.T, raw string) {
			data := sse(t, strings.NewReader(raw))
			last := data[len(data)-1]
			if len(data) != 1+5+1 || !strings.HasPrefix(last, `{"type":"response.completed"`) || !strings.Contains(last, llmtest.ResponsesUsage(35, 8)) ||
				strings.Count(raw, "event: response.output_text.delta\n") != 5 {
				t.Errorf("stream = %v, want created, five deltas and response.completed with its usage, as sent", data)
			}
		}},
	}
	want := map[[2]int64]string{}
	for _, c := range cases {
		g.up.Set(llmtest.Behaviour{PromptTokens: c.in, CompletionTokens: c.out})
		resp, raw := g.post(llmKey, c.path, c.body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s = %d %s", c.name, resp.StatusCode, raw)
		}
		t.Run(c.name, func(t *testing.T) { c.check(t, raw) })
		want[[2]int64{c.in, c.out}] = c.name
	}
	seen := g.up.Requests()
	for i, r := range seen {
		if r.Path != cases[i].path || r.Authorization != "Bearer upstream-secret" {
			t.Errorf("upstream request %d = %s %q, want %s with the upstream's key", i, r.Path, r.Authorization, cases[i].path)
		}
	}
	for _, i := range []int{1, 2} { // completions streams: the gateway asks for the usage
		if so, _ := seen[i].Body["stream_options"].(map[string]any); so["include_usage"] != true {
			t.Errorf("%s reached the upstream without include_usage: %v", cases[i].name, seen[i].Body)
		}
	}
	actual, released := g.settled()
	if len(actual) != len(cases) || len(released) != 0 {
		t.Fatalf("actual %v, released %v; want %d actual events", actual, released, len(cases))
	}
	for _, a := range actual {
		name, ok := want[[2]int64{a.InputTokens, a.OutputTokens}]
		if !ok {
			t.Errorf("actual %+v is no usage the stand-in reported", a)
			continue
		}
		delete(want, [2]int64{a.InputTokens, a.OutputTokens})
		if path := map[bool]string{true: "/v1/responses", false: "/v1/completions"}[strings.HasPrefix(name, "responses")]; a.Endpoint != path {
			t.Errorf("%s charged as endpoint %q, want %q", name, a.Endpoint, path)
		}
	}
}

// TestGatewayStreamBackPressure: a client that reads nothing of a long
// stream stops the stand-in's writing (the gateway reads the upstream only
// as fast as the client takes it, instead of buffering the stream), and a
// client that leaves then is charged what passed.
func TestGatewayStreamBackPressure(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	// 128 MiB of text, more than every socket buffer on the way can hold
	// (the kernel's tcp_rmem allows 32 MiB a socket here).
	const n, size = 2048, 64 << 10
	word := strings.Repeat(" hello", size/6)
	words := make([]string, n)
	for i := range words {
		words[i] = word
	}
	g.up.Set(llmtest.Behaviour{Words: words, PromptTokens: 11, CompletionTokens: n * size / 6})
	conn, err := net.Dial("tcp", g.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	body := chat(true, false, 50)
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		llmKey, len(body), body)
	// Wait until the stand-in's writing started, then stopped moving (or
	// it wrote it all): polling decides when to look, not what is asserted.
	written, still := int64(0), 0
	for deadline := time.Now().Add(60 * time.Second); still < 20 && written < n && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if w := g.up.Written(); w == written && w > 0 {
			still++
		} else {
			written, still = w, 0
		}
	}
	if written == 0 {
		t.Fatal("the stand-in wrote no word")
	}
	if written >= n/2 {
		t.Fatalf("the stand-in wrote %d of %d words (%d MiB) to a client that read nothing: the gateway buffers the stream", written, n, written*size>>20)
	}
	t.Logf("the stand-in stopped after %d of %d words (%d MiB)", written, n, written*size>>20)
	// The client reads the head, then leaves.
	head, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.HasPrefix(head, "HTTP/1.1 200") {
		t.Fatalf("status line = %q, %v", head, err)
	}
	conn.Close()
	actual, released := g.settled()
	if len(actual) != 1 || len(released) != 0 {
		t.Fatalf("actual %v, released %v; want one actual", actual, released)
	}
	// On a busy host the stand-in may write more after the pause taken
	// for its stop: what passed is bounded by all it wrote by now. Past its
	// first 64 KiB, a stream's text counts a token per 3 bytes at least
	// (" hello" is 6), so the bound is at that rate.
	written = g.up.Written()
	most := (written + 1) * int64(math.Ceil(size/openai.DefaultBytesPerToken))
	for _, a := range actual {
		if a.OutputTokens <= 0 || a.OutputTokens > most {
			t.Errorf("charged output %d, want what passed: at most the %d words written (%d tokens)", a.OutputTokens, written+1, most)
		}
	}
}
