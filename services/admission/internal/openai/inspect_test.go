package openai

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"math/rand"
	"os"
	"strings"
	"sync"
	"testing"

	"quotaflow/pkg/limits"
)

// tok counts s with the library itself, on the whole text: the reference
// the package's counts are checked against.
func tok(t testing.TB, encoding, s string) int64 {
	t.Helper()
	e, err := loadEncoding(encoding)
	if err != nil {
		t.Fatal(err)
	}
	return int64(len(e.tk.EncodeOrdinary(s)))
}

func TestKindOf(t *testing.T) {
	for path, want := range map[string]Kind{
		"/v1/chat/completions": Chat, "/v1/completions": Completions,
		"/v1/embeddings": Embeddings, "/v1/responses": Responses,
	} {
		if k, ok := KindOf(path); !ok || k != want || k.String() != path {
			t.Errorf("KindOf(%q) = %v, %v, want %v", path, k, ok, want)
		}
	}
	for _, path := range []string{"", "/v1/chat/completions/", "/v1/models", "/V1/completions", "/v1/completions?x=1", "v1/embeddings"} {
		if k, ok := KindOf(path); ok {
			t.Errorf("KindOf(%q) = %v, want none", path, k)
		}
	}
}

func TestEncodingOf(t *testing.T) {
	for model, want := range map[string]string{
		"gpt-4o": o200k, "gpt-4o-mini-2024-07-18": o200k, "openai/gpt-4.1-nano": o200k,
		"o1": o200k, "o3-mini": o200k, "gpt-5.1": o200k, "gpt-oss-120b": o200k,
		"gpt-4": cl100k, "gpt-4-0613": cl100k, "gpt-4-turbo": cl100k, "gpt-3.5-turbo-0125": cl100k,
		"text-embedding-3-small": cl100k, "gpt-35-turbo": cl100k,
		"o10": "", "gpt-4x": "", "llama-3.1-8b": "", "meta-llama/Llama-3.1-8B-Instruct": "", "": "",
	} {
		if got := encodingOf(model); got != want {
			t.Errorf("encodingOf(%q) = %q, want %q", model, got, want)
		}
	}
}

// cookbook is the example of OpenAI's "How to count tokens with tiktoken",
// whose prompt the API itself counts as 129 tokens on gpt-4 and
// gpt-3.5-turbo and 124 on gpt-4o.
const cookbook = `[
 {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
 {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
 {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
 {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
 {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
 {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."}
]`

func TestInspectCookbook(t *testing.T) {
	for model, want := range map[string]int64{"gpt-4o": 124, "gpt-4o-mini": 124, "gpt-4": 129, "gpt-3.5-turbo": 129} {
		body := `{"model":"` + model + `","messages":` + cookbook + `,"max_tokens":10}`
		r, err := Inspect(Chat, []byte(body), Options{})
		if err != nil {
			t.Fatal(err)
		}
		if r.InputTokens != want {
			t.Errorf("Inspect(%s cookbook).InputTokens = %d, want %d (what the API counts)", model, r.InputTokens, want)
		}
	}
}

func TestInspect(t *testing.T) {
	hello := func(enc string) int64 { return 3 + 3 + tok(t, enc, "user") + tok(t, enc, "Hello there") }
	const msgs = `"messages":[{"role":"user","content":"Hello there"}]`
	cases := []struct {
		name   string
		kind   Kind
		body   string
		want   Request // Body compared as a string; Model and counts too
		sameIn bool    // Body is the very slice passed in
	}{
		{"chat sets the default maximum", Chat,
			`{"model":"gpt-4o",` + msgs + `}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 4096,
				Body: []byte(`{"model":"gpt-4o",` + msgs + `,"max_tokens":4096}`)}, false},
		{"chat stream asks for usage", Chat,
			`{"model":"gpt-4o",` + msgs + `,"stream":true}`,
			Request{Model: "gpt-4o", Stream: true, InputTokens: hello(o200k), OutputTokens: 4096,
				Body: []byte(`{"model":"gpt-4o",` + msgs + `,"stream":true,"max_tokens":4096,"stream_options":{"include_usage":true}}`)}, false},
		{"chat stream the client asked for usage", Chat,
			`{"model":"gpt-4", "stream": true, "stream_options": {"include_usage": true}, ` + msgs + `, "max_tokens": 7}`,
			Request{Model: "gpt-4", Stream: true, IncludeUsage: true, InputTokens: hello(cl100k), OutputTokens: 7,
				Body: []byte(`{"model":"gpt-4", "stream": true, "stream_options": {"include_usage": true}, ` + msgs + `, "max_tokens": 7}`)}, true},
		{"chat stream options kept, usage added", Chat,
			`{"model":"gpt-4o","stream":true,"stream_options":{"x":[1]},` + msgs + `,"max_completion_tokens":9}`,
			Request{Model: "gpt-4o", Stream: true, InputTokens: hello(o200k), OutputTokens: 9,
				Body: []byte(`{"model":"gpt-4o","stream":true,"stream_options":{"x":[1],"include_usage":true},` + msgs + `,"max_completion_tokens":9,"max_tokens":9}`)}, false},
		{"chat stream include_usage false turned true", Chat,
			`{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":false,"y":2},` + msgs + `,"max_tokens":null}`,
			Request{Model: "gpt-4o", Stream: true, InputTokens: hello(o200k), OutputTokens: 4096,
				Body: []byte(`{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true,"y":2},` + msgs + `,"max_tokens":4096}`)}, false},
		{"chat stream_options untouched without a stream", Chat,
			`{"model":"gpt-4o","stream_options":{},` + msgs + `,"max_tokens":5}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 5,
				Body: []byte(`{"model":"gpt-4o","stream_options":{},` + msgs + `,"max_tokens":5}`)}, true},
		{"a maximum named null is written too", Chat,
			`{"model":"gpt-4o","n_predict":null,"max_completion_tokens":null,"max_tokens":12,` + msgs + `}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 12,
				Body: []byte(`{"model":"gpt-4o","n_predict":12,"max_completion_tokens":12,"max_tokens":12,` + msgs + `}`)}, false},
		{"chat n times the larger maximum, written into both", Chat,
			`{"model":"gpt-4o","n":3,"max_tokens":50,"max_completion_tokens":200,` + msgs + `}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 600,
				Body: []byte(`{"model":"gpt-4o","n":3,"max_tokens":200,"max_completion_tokens":200,` + msgs + `}`)}, false},
		{"llama.cpp's n_predict is a maximum too", Chat,
			`{"model":"gpt-4o","n_predict":9000,"max_tokens":10,` + msgs + `}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 9000,
				Body: []byte(`{"model":"gpt-4o","n_predict":9000,"max_tokens":9000,` + msgs + `}`)}, false},
		// vLLM and Ollama ignore n_predict: the maximum must reach max_tokens.
		{"n_predict alone caps max_tokens too", Chat,
			`{"model":"llama-3.1-8b","n_predict":1,` + msgs + `}`,
			Request{Model: "llama-3.1-8b", InputTokens: 3 + 3 + 2 + 4, OutputTokens: 1,
				Body: []byte(`{"model":"llama-3.1-8b","n_predict":1,` + msgs + `,"max_tokens":1}`)}, false},
		// TGI, older vLLM and llama.cpp read only max_tokens.
		{"max_completion_tokens on a non-reasoning model caps max_tokens", Chat,
			`{"model":"gpt-4o","max_completion_tokens":1,` + msgs + `}`,
			Request{Model: "gpt-4o", InputTokens: hello(o200k), OutputTokens: 1,
				Body: []byte(`{"model":"gpt-4o","max_completion_tokens":1,` + msgs + `,"max_tokens":1}`)}, false},
		{"max_tokens on a reasoning model caps max_completion_tokens", Chat,
			`{"model":"o3-mini","max_tokens":5,` + msgs + `}`,
			Request{Model: "o3-mini", InputTokens: hello(o200k), OutputTokens: 5,
				Body: []byte(`{"model":"o3-mini","max_tokens":5,` + msgs + `,"max_completion_tokens":5}`)}, false},
		{"completions: n_predict caps max_tokens", Completions,
			`{"model":"davinci-002","prompt":"x","n_predict":3,"max_tokens":2}`,
			Request{Model: "davinci-002", InputTokens: tok(t, cl100k, "x"), OutputTokens: 3,
				Body: []byte(`{"model":"davinci-002","prompt":"x","n_predict":3,"max_tokens":3}`)}, false},
		{"reasoning model gets max_completion_tokens", Chat,
			`{"model":"o3-mini",` + msgs + `,"n":2}`,
			Request{Model: "o3-mini", InputTokens: hello(o200k), OutputTokens: 8192,
				Body: []byte(`{"model":"o3-mini",` + msgs + `,"n":2,"max_completion_tokens":4096}`)}, false},
		{"unknown model falls back to bytes", Chat,
			`{"model":"llama-3.1-8b",` + msgs + `,"max_tokens":1}`,
			Request{Model: "llama-3.1-8b", InputTokens: 3 + 3 + 2 + 4, OutputTokens: 1, // ⌈4/3⌉ + ⌈11/3⌉
				Body: []byte(`{"model":"llama-3.1-8b",` + msgs + `,"max_tokens":1}`)}, true},
		{"parts, media, tools, names and tool calls", Chat,
			`{"model":"gpt-4o","max_tokens":1,"tools":[{"type":"function","function":{"name":"f"}}],"messages":[` +
				`{"role":"user","name":"ann","content":[{"type":"text","text":"Look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]},` +
				`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]}]}`,
			Request{Model: "gpt-4o", OutputTokens: 1,
				InputTokens: 3 + tok(t, o200k, `[{"type":"function","function":{"name":"f"}}]`) +
					3 + 1 + tok(t, o200k, "user") + tok(t, o200k, "ann") + tok(t, o200k, "Look") + MediaTokens +
					3 + tok(t, o200k, "assistant") + tok(t, o200k, "f") + tok(t, o200k, `{"a":1}`)}, true},
		{"completions: prompts × best_of × the API's 16", Completions,
			`{"model":"gpt-3.5-turbo-instruct","prompt":["Say this","Say that"],"n":2,"best_of":3,"stream":true}`,
			Request{Model: "gpt-3.5-turbo-instruct", Stream: true, OutputTokens: 2 * 3 * 16,
				InputTokens: tok(t, cl100k, "Say this") + tok(t, cl100k, "Say that"),
				Body:        []byte(`{"model":"gpt-3.5-turbo-instruct","prompt":["Say this","Say that"],"n":2,"best_of":3,"stream":true,"max_tokens":16,"stream_options":{"include_usage":true}}`)}, false},
		{"completions: token ids and a suffix", Completions,
			`{"model":"davinci-002","prompt":[[1,2,3],[4]],"suffix":"end.","max_tokens":10}`,
			Request{Model: "davinci-002", OutputTokens: 20, InputTokens: 4 + 2*tok(t, cl100k, "end.")}, true},
		{"embeddings: inputs, no output", Embeddings,
			`{"model":"text-embedding-3-small","input":["one fish","two fish"],"stream":"ignored"}`,
			Request{Model: "text-embedding-3-small", InputTokens: tok(t, cl100k, "one fish") + tok(t, cl100k, "two fish")}, true},
		{"embeddings: a token id is any whole number up to 2^31-1", Embeddings,
			`{"model":"text-embedding-3-small","input":[[0, 1.0 ,1e3,2147483647],"x"]}`,
			Request{Model: "text-embedding-3-small", InputTokens: 4 + tok(t, cl100k, "x")}, true},
		{"embeddings: token ids", Embeddings,
			`{"model":"text-embedding-3-small","input":[5,6,7]}`,
			Request{Model: "text-embedding-3-small", InputTokens: 3}, true},
		{"responses: instructions and a string input", Responses,
			`{"model":"gpt-4.1","instructions":"Be brief.","input":"Hello there","stream":true}`,
			Request{Model: "gpt-4.1", Stream: true, OutputTokens: 4096,
				InputTokens: 3 + 3 + tok(t, o200k, "Be brief.") + hello(o200k) - 3,
				Body:        []byte(`{"model":"gpt-4.1","instructions":"Be brief.","input":"Hello there","stream":true,"max_output_tokens":4096}`)}, false},
		{"responses: items", Responses,
			`{"model":"gpt-4o","max_output_tokens":64,"input":[{"role":"user","content":[{"type":"input_text","text":"Hi"},{"type":"input_image","image_url":"https://x/y.png"}]},{"type":"function_call_output","call_id":"c","output":"42"}]}`,
			Request{Model: "gpt-4o", OutputTokens: 64,
				InputTokens: 3 + 3 + tok(t, o200k, "user") + tok(t, o200k, "Hi") + MediaTokens + 3 + tok(t, o200k, "c") + tok(t, o200k, "42")}, true},
		// Only content parts are media or files: a message's own type is
		// ignored upstream, and its text counted here.
		{"a message typed as an image counts its text", Chat,
			`{"model":"gpt-4o","max_tokens":1,"messages":[{"role":"user","type":"image_url","content":"Hello there"}]}`,
			Request{Model: "gpt-4o", OutputTokens: 1, InputTokens: hello(o200k)}, true},
		{"responses: an item typed as a file counts its text", Responses,
			`{"model":"gpt-4o","max_output_tokens":1,"input":[{"role":"user","type":"input_file","content":"Hello there"}]}`,
			Request{Model: "gpt-4o", OutputTokens: 1, InputTokens: hello(o200k)}, true},
		// The body holds no text of a file or of the context kept upstream:
		// each counts Options.ReferenceTokens.
		{"chat file parts count the reference floor", Chat,
			`{"model":"gpt-4o","max_tokens":1,"messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"file-abc"}},{"type":"file","file":{"file_data":"data:application/pdf;base64,AAAA"}}]}]}`,
			Request{Model: "gpt-4o", OutputTokens: 1, InputTokens: 3 + 3 + tok(t, o200k, "user") + 2*DefaultReferenceTokens}, true},
		{"responses: stored context and an input file count the reference floor", Responses,
			`{"model":"gpt-4o","max_output_tokens":8,"previous_response_id":"resp_1","conversation":"conv_1","input":[{"role":"user","content":[{"type":"input_file","file_id":"file-abc"}]}]}`,
			Request{Model: "gpt-4o", OutputTokens: 8, InputTokens: 3 + 2*DefaultReferenceTokens + 3 + tok(t, o200k, "user") + DefaultReferenceTokens}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := []byte(c.body)
			r, err := Inspect(c.kind, in, Options{})
			if err != nil {
				t.Fatalf("Inspect: %v", err)
			}
			if c.sameIn {
				c.want.Body = in
				if &r.Body[0] != &in[0] {
					t.Errorf("Inspect copied a body it did not change")
				}
			}
			if r.Model != c.want.Model || r.Stream != c.want.Stream || r.IncludeUsage != c.want.IncludeUsage ||
				r.InputTokens != c.want.InputTokens || r.OutputTokens != c.want.OutputTokens {
				t.Errorf("Inspect = %+v, want %+v", noBody(r), noBody(c.want))
			}
			if !bytes.Equal(r.Body, c.want.Body) {
				t.Errorf("Inspect body\n got %s\nwant %s", r.Body, c.want.Body)
			}
		})
	}
}

func noBody(r Request) Request { r.Body = nil; return r }

// TestInspectKeepsUnknownFields: every field Inspect does not set reaches
// the upstream as the client wrote it, spacing and escapes included.
func TestInspectKeepsUnknownFields(t *testing.T) {
	body := "{\n  \"model\" : \"gpt-4o\",\n  \"Model\": \"not read\",\n  \"temperature\": 0.70,\n" +
		"  \"metadata\": {\"k\": [1, 2.50e3, {\"q\": null}], \"u\": \"\\u00e9\\ud83d\\ude00\"},\n" +
		"  \"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"extra\": true}],\n  \"stream\": true\n}\n"
	r, err := Inspect(Chat, []byte(body), Options{DefaultMaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(body, "\"stream\": true\n}", "\"stream\": true,\"max_tokens\":100,\"stream_options\":{\"include_usage\":true}\n}", 1)
	if string(r.Body) != want {
		t.Fatalf("Inspect body\n got %s\nwant %s", r.Body, want)
	}
}

func TestInspectErrors(t *testing.T) {
	deep := `{"model":"gpt-4o","messages":[{"role":"user","content":` + strings.Repeat("[", 40) + strings.Repeat("]", 40) + `}]}`
	cases := []struct {
		name, body, field string
		kind              Kind
	}{
		{"not utf-8", "{\"model\":\"gpt-4o\xff\",\"messages\":[]}", "body", Chat},
		{"not an object", `["model"]`, "body", Chat},
		{"not json", `{"model":`, "body", Chat},
		{"trailing data", `{"model":"gpt-4o","messages":[{"role":"user","content":"x"}]} {}`, "body", Chat},
		{"repeated field", `{"model":"gpt-4o","model":"gpt-4","messages":[{"role":"user","content":"x"}]}`, "body", Chat},
		{"no model", `{"messages":[{"role":"user","content":"x"}]}`, "model", Chat},
		{"empty model", `{"model":"","messages":[{"role":"user","content":"x"}]}`, "model", Chat},
		{"model not a string", `{"model":4,"input":"x"}`, "model", Embeddings},
		{"long model", `{"model":"` + strings.Repeat("m", 257) + `","input":"x"}`, "model", Embeddings},
		{"control in model", `{"model":"gpt\n4o","input":"x"}`, "model", Embeddings},
		{"n 0", `{"model":"gpt-4o","n":0,"messages":[{"role":"user","content":"x"}]}`, "n", Chat},
		{"n 129", `{"model":"gpt-4o","n":129,"messages":[{"role":"user","content":"x"}]}`, "n", Chat},
		{"n fraction", `{"model":"gpt-4o","n":1.5,"messages":[{"role":"user","content":"x"}]}`, "n", Chat},
		{"n string", `{"model":"gpt-4o","n":"2","messages":[{"role":"user","content":"x"}]}`, "n", Chat},
		{"best_of 0", `{"model":"davinci-002","best_of":0,"prompt":"x"}`, "best_of", Completions},
		{"max_tokens 0", `{"model":"gpt-4o","max_tokens":0,"messages":[{"role":"user","content":"x"}]}`, "max_tokens", Chat},
		{"max_completion_tokens huge", `{"model":"gpt-4o","max_completion_tokens":1048577,"messages":[{"role":"user","content":"x"}]}`, "max_completion_tokens", Chat},
		{"n_predict unlimited", `{"model":"davinci-002","n_predict":-1,"prompt":"x"}`, "n_predict", Completions},
		{"max_output_tokens negative", `{"model":"gpt-4o","max_output_tokens":-1,"input":"x"}`, "max_output_tokens", Responses},
		{"no messages", `{"model":"gpt-4o"}`, "messages", Chat},
		{"empty messages", `{"model":"gpt-4o","messages":[]}`, "messages", Chat},
		{"messages an object", `{"model":"gpt-4o","messages":{"role":"user"}}`, "messages", Chat},
		{"message a string", `{"model":"gpt-4o","messages":["hi"]}`, "messages[0]", Chat},
		{"role a number", `{"model":"gpt-4o","messages":[{"role":1,"content":"x"}]}`, "messages[0].role", Chat},
		{"too deep", deep, "messages[0]", Chat},
		{"stream a string", `{"model":"gpt-4o","stream":"yes","messages":[{"role":"user","content":"x"}]}`, "stream", Chat},
		{"stream_options a list", `{"model":"gpt-4o","stream":true,"stream_options":[],"messages":[{"role":"user","content":"x"}]}`, "stream_options", Chat},
		{"include_usage a string", `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":"yes"},"messages":[{"role":"user","content":"x"}]}`, "stream_options.include_usage", Chat},
		{"include_usage twice", `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":false,"include_usage":true},"messages":[{"role":"user","content":"x"}]}`, "stream_options", Chat},
		{"empty prompt list", `{"model":"davinci-002","prompt":[]}`, "prompt", Completions},
		{"empty token list", `{"model":"davinci-002","prompt":[[]]}`, "prompt", Completions},
		{"negative token id", `{"model":"davinci-002","prompt":[1,-1]}`, "prompt", Completions},
		{"mixed prompt", `{"model":"davinci-002","prompt":[1,"x"]}`, "prompt", Completions},
		{"token id 2^31", `{"model":"davinci-002","prompt":[[1],[2147483648]]}`, "prompt", Completions},
		{"fractional token id", `{"model":"davinci-002","prompt":["x",[1.5]]}`, "prompt", Completions},
		{"token ids nested deeper", `{"model":"davinci-002","prompt":[[[1]]]}`, "prompt", Completions},
		{"prompt an object", `{"model":"davinci-002","prompt":{}}`, "prompt", Completions},
		{"suffix a number", `{"model":"davinci-002","prompt":"x","suffix":1}`, "suffix", Completions},
		{"no input", `{"model":"text-embedding-3-small"}`, "input", Embeddings},
		{"too many inputs", `{"model":"text-embedding-3-small","input":[` + strings.Repeat(`"x",`, MaxItems) + `"x"]}`, "input", Embeddings},
		{"responses input a number", `{"model":"gpt-4o","input":3}`, "input", Responses},
		{"responses item a string", `{"model":"gpt-4o","input":["x"]}`, "input[0]", Responses},
		{"instructions an object", `{"model":"gpt-4o","instructions":{},"input":"x"}`, "instructions", Responses},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Inspect(c.kind, []byte(c.body), Options{})
			var fe *FieldError
			if !errors.As(err, &fe) || !errors.Is(err, ErrInvalid) || fe.Field != c.field {
				t.Fatalf("Inspect(%s) = %v, want a FieldError on %q", c.body, err, c.field)
			}
		})
	}
	for _, body := range []string{`{"model":"gpt-4o","messages":[{"role":"user","content":"secret-value"}]} secret-tail`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"secret-value" secret-tail}]}`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"secret-value`,
		`{"model":"gpt-4o","` + strings.Repeat("k", 100) + `":1,"` + strings.Repeat("k", 100) + `":2}`} {
		_, err := Inspect(Chat, []byte(body), Options{})
		if err == nil || strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "kkk") {
			t.Errorf("Inspect(%s) = %v, want an error that repeats nothing of the body", body, err)
		}
	}
	big := `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("x", 100) + `"}]}`
	if _, err := Inspect(Chat, []byte(big), Options{MaxBody: 100}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("Inspect(%d bytes, MaxBody 100) = %v, want ErrTooLarge", len(big), err)
	}
	for _, o := range []Options{{DefaultMaxTokens: MaxTokens + 1}, {DefaultMaxTokens: -1}, {BytesPerToken: -1}, {BytesPerToken: math.NaN()}, {BytesPerToken: math.Inf(1)}, {BytesPerToken: 1e-300}, {BytesPerToken: MinBytesPerToken / 2}, {BytesPerToken: 2 * MaxBytesPerToken}} {
		if _, err := Inspect(Chat, []byte(big), o); err == nil || errors.Is(err, ErrInvalid) {
			t.Errorf("Inspect with %+v = %v, want a configuration error", o, err)
		}
	}
}

// A model without an encoding counts a text at Options.BytesPerToken, at
// most MaxTokens: 4 MiB at 1 byte a token counts MaxTokens, not 4 Mi.
func TestInspectFallbackCountAtMostMaxTokens(t *testing.T) {
	chat := func(content string) Request {
		t.Helper()
		r, err := Inspect(Chat, []byte(`{"model":"llama-3","messages":[{"role":"user","content":"`+content+`"}]}`), Options{BytesPerToken: 1})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	small, big := chat("x"), chat(strings.Repeat("x", 4<<20))
	if got := big.InputTokens - small.InputTokens; got != MaxTokens-1 {
		t.Errorf("a 4 MiB text counts %d tokens more than a 1-byte one, want MaxTokens-1 = %d", got, MaxTokens-1)
	}
}

// TestInspectRefusesHugeItemsUnread: messages or input items holding more
// than maxValues objects, arrays and elements are refused before they are
// decoded (8 MiB of empty objects decoded took ~250 MB), at the top level
// or within one message, with a few allocations.
func TestInspectRefusesHugeItemsUnread(t *testing.T) {
	empties := strings.TrimSuffix(strings.Repeat("{},", maxValues), ",")
	for _, c := range []struct {
		name, body, field string
		kind              Kind
	}{
		{"chat messages", `{"model":"gpt-4o","messages":[` + empties + `]}`, "messages", Chat},
		{"parts of one message", `{"model":"gpt-4o","messages":[{"role":"user","content":[` + empties + `]}]}`, "messages", Chat},
		{"responses input", `{"model":"gpt-4o","input":[` + empties + `]}`, "input", Responses},
	} {
		t.Run(c.name, func(t *testing.T) {
			var err error
			allocs := testing.AllocsPerRun(1, func() { _, err = Inspect(c.kind, []byte(c.body), Options{}) })
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != c.field {
				t.Errorf("Inspect(%d values) = %v, want a FieldError on %q", maxValues, err, c.field)
			}
			if allocs > 100 {
				t.Errorf("Inspect(%d values) made %v allocations, want them refused before decoding", maxValues, allocs)
			}
		})
	}
}

// TestInspectCountsTokenIDsUndecoded: a prompt or input of token ids is
// read without decoding it (6 MiB of ids decoded took ~100 MB): ids in
// arrays are counted, however many, and one flat prompt of more than
// MaxItems ids is refused, both with a few allocations.
func TestInspectCountsTokenIDsUndecoded(t *testing.T) {
	const perArray = 1 << 20 // 2 MiB of "7,"
	ids := "[" + strings.Repeat("7,", perArray-1) + "7]"
	nested := "[" + ids + "," + ids + "," + ids + "]"
	for _, c := range []struct {
		name, body, field string
		kind              Kind
		tokens            int64
	}{
		{"arrays of ids", `{"model":"davinci-002","max_tokens":1,"prompt":` + nested + `}`, "", Completions, 3 * perArray},
		{"arrays of ids and a text", `{"model":"text-embedding-3-small","input":[` + ids + `,"x"]}`, "", Embeddings, perArray + 1},
		{"one flat prompt of ids", `{"model":"davinci-002","max_tokens":1,"prompt":` + ids + `}`, "", Completions, perArray},
		{"one flat prompt of ids, one not an id", `{"model":"davinci-002","prompt":` + ids[:len(ids)-2] + `1.5]}`, "prompt", Completions, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			var r Request
			var err error
			allocs := testing.AllocsPerRun(1, func() { r, err = Inspect(c.kind, []byte(c.body), Options{}) })
			if c.field == "" && (err != nil || r.InputTokens != c.tokens) {
				t.Errorf("Inspect = %d tokens, %v; want %d", r.InputTokens, err, c.tokens)
			}
			var fe *FieldError
			if c.field != "" && (!errors.As(err, &fe) || fe.Field != c.field) {
				t.Errorf("Inspect = %v, want a FieldError on %q", err, c.field)
			}
			if allocs > 100 {
				t.Errorf("Inspect(%d bytes) made %v allocations, want the ids read undecoded", len(c.body), allocs)
			}
		})
	}
}

// TestInspectBodyDecodes: the rewritten body decodes to the client's fields
// plus exactly the ones Inspect set.
func TestInspectBodyDecodes(t *testing.T) {
	body := `{"model":"gpt-4o","a":{"b":[1,"2",null]},"stream":true,"stream_options":{"c":1},"messages":[{"role":"user","content":"x"}]}`
	r, err := Inspect(Chat, []byte(body), Options{})
	if err != nil {
		t.Fatal(err)
	}
	var before, after map[string]any
	if err := json.Unmarshal([]byte(body), &before); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(r.Body, &after); err != nil {
		t.Fatalf("rewritten body %s: %v", r.Body, err)
	}
	before["max_tokens"] = float64(DefaultMaxTokens)
	before["stream_options"].(map[string]any)["include_usage"] = true
	if fmt.Sprint(before) != fmt.Sprint(after) {
		t.Errorf("rewritten body decodes to %v, want %v", after, before)
	}
}

func TestLimitsFitTheEngine(t *testing.T) {
	if MaxItems*MaxChoices*MaxTokens > limits.MaxCost {
		t.Errorf("MaxItems × MaxChoices × MaxTokens = %d exceeds limits.MaxCost %d", MaxItems*MaxChoices*MaxTokens, int64(limits.MaxCost))
	}
}

// TestCountMatchesTheTokenizer: counting in segments gives the tokenizer's
// count of the whole text for prose and code, and stays within a token per
// cut for text with no cut a token cannot cross (Chinese, base64).
func TestCountMatchesTheTokenizer(t *testing.T) {
	corpus := readCorpus(t)
	cjk := strings.Index(corpus, "配额流")
	prose := corpus[:cjk]
	for _, enc := range []string{o200k, cl100k} {
		model := map[string]string{o200k: "gpt-4o", cl100k: "gpt-4"}[enc]
		for start := 0; start < len(prose); start += 4000 {
			s := prose[start:min(start+4000, len(prose))]
			if got, want := newCounter(model, 0).count(s), tok(t, enc, s); got != want {
				t.Errorf("%s count(corpus[%d:]) = %d, want %d", enc, start, got, want)
			}
		}
		for _, s := range []string{corpus[cjk:], strings.Repeat("QUJDREVGR0g=", 100)} {
			got, want := newCounter(model, 0).count(s), tok(t, enc, s)
			if cuts := int64(len(s)/segment) + 1; got < want-cuts || got > want+cuts {
				t.Errorf("%s count(%.20q...) = %d, want %d ± %d", enc, s, got, want, cuts)
			}
		}
	}
}

// TestCountBeyondExactBytes: past exactBytes the rest is extrapolated at
// the ratio measured, or minTokensPerByte when that is more. Prose (fewer
// tokens a byte) is never under-counted, nor counted past the bytes
// fallback; a dense text is counted at its own ratio; and whatever the
// first 64 KiB hold (the caller's choice: blanks at 128 bytes a token), a
// text after them counts at least the bytes fallback's ratio.
func TestCountBeyondExactBytes(t *testing.T) {
	prose := readCorpus(t)
	prose = prose[:strings.Index(prose, "配额流")]
	long := strings.Repeat(prose, 1+2*exactBytes/len(prose))
	got, want := newCounter("gpt-4o", 0).count(long), tok(t, o200k, long)
	if fallback := newCounter("", 0).count(long); got < want || got > fallback {
		t.Errorf("count(%d bytes of prose) = %d, want from its %d tokens to the fallback's %d", len(long), got, want, fallback)
	}
	random := make([]byte, 2*exactBytes)
	rand.New(rand.NewSource(1)).Read(random)
	dense := base64.StdEncoding.EncodeToString(random) // ~0.7 tokens a byte
	sample := newCounter("gpt-4o", 0).count(dense[:exactBytes])
	if got := newCounter("gpt-4o", 0).count(dense[:2*exactBytes]); got < 2*sample-2 {
		t.Errorf("count(2 × %d bytes of base64) = %d, want about twice the first half's %d", exactBytes, got, sample)
	}
	c := newCounter("gpt-4o", 0)
	c.count(strings.Repeat(" ", exactBytes))
	if got, least := c.count(dense), int64(float64(len(dense))/DefaultBytesPerToken); got < least {
		t.Errorf("after %d blanks, count(%d bytes of base64) = %d, want at least %d", exactBytes, len(dense), got, least)
	}
}

func readCorpus(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("testdata/corpus.txt")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestInspectConcurrent: encodings load once under concurrent first use,
// and every Inspect counts the same.
func TestInspectConcurrent(t *testing.T) {
	body := []byte(`{"model":"gpt-4o","messages":` + cookbook + `}`)
	var wg sync.WaitGroup
	got := make([]int64, 8)
	for i := range got {
		wg.Go(func() {
			r, err := Inspect(Chat, body, Options{})
			if err != nil {
				t.Error(err)
			}
			got[i] = r.InputTokens
		})
	}
	wg.Wait()
	for i, n := range got {
		if n != 124 {
			t.Errorf("Inspect %d: InputTokens = %d, want 124", i, n)
		}
	}
}

// TestCountCache: a long text's count is remembered, the same as counted,
// a text in the same slot evicts it, and a text past the budget is not
// remembered (its count depends on what came before).
func TestCountCache(t *testing.T) {
	s := "The count cache keeps the token count of texts of at least sixty-four bytes."
	first := newCounter("gpt-4o", 0)
	if got, want := first.count(s), tok(t, o200k, s); got != want {
		t.Fatalf("count(%q) = %d, want %d", s, got, want)
	}
	h := maphash.String(first.cache.seed, s)
	if n, ok := first.cache.get(h); !ok || n != tok(t, o200k, s) {
		t.Fatalf("cache.get after count = %d, %v; want %d", n, ok, tok(t, o200k, s))
	}
	if got := newCounter("gpt-4o", 0).count(s); got != tok(t, o200k, s) {
		t.Errorf("count(%q) remembered = %d, want %d", s, got, tok(t, o200k, s))
	}
	first.cache.put(h+cacheSlots, 7)
	if n, ok := first.cache.get(h); ok {
		t.Errorf("cache.get after its slot was taken = %d, want none", n)
	}
	full := newCounter("gpt-4o", 0)
	full.bytes = exactBytes
	long := strings.Repeat("An extrapolated text is not remembered. ", 4)
	full.count(long)
	if n, ok := full.cache.get(maphash.String(full.cache.seed, long)); ok {
		t.Errorf("a text counted past the budget was remembered as %d", n)
	}
}

// TestInspectCapsEveryMaximum: whatever maximum field a body uses, on any
// generating endpoint, the largest is the estimate and every maximum field
// the upstream receives carries it: llama.cpp copies a responses body into
// a chat body where n_predict wins, vLLM prefers max_completion_tokens.
func TestInspectCapsEveryMaximum(t *testing.T) {
	cases := []struct {
		name string
		kind Kind
		body string
		out  int64
		want string
	}{
		{"responses n_predict", Responses,
			`{"model":"m","input":"hi","max_output_tokens":16,"n_predict":1000000}`, 1000000,
			`{"model":"m","input":"hi","max_output_tokens":1000000,"n_predict":1000000}`},
		{"responses n_predict alone", Responses,
			`{"model":"m","input":"hi","n_predict":5}`, 5,
			`{"model":"m","input":"hi","n_predict":5,"max_output_tokens":5}`},
		{"responses max_tokens", Responses,
			`{"model":"m","input":"hi","max_tokens":900,"max_output_tokens":16}`, 900,
			`{"model":"m","input":"hi","max_tokens":900,"max_output_tokens":900}`},
		{"responses max_completion_tokens", Responses,
			`{"model":"m","input":"hi","max_completion_tokens":700}`, 700,
			`{"model":"m","input":"hi","max_completion_tokens":700,"max_output_tokens":700}`},
		{"completions max_completion_tokens", Completions,
			`{"model":"m","prompt":"x","max_completion_tokens":300,"max_tokens":2}`, 300,
			`{"model":"m","prompt":"x","max_completion_tokens":300,"max_tokens":300}`},
		{"completions max_output_tokens", Completions,
			`{"model":"m","prompt":"x","max_output_tokens":40}`, 40,
			`{"model":"m","prompt":"x","max_output_tokens":40,"max_tokens":40}`},
		{"chat max_output_tokens", Chat,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"max_output_tokens":50,"n_predict":3}`, 50,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"max_output_tokens":50,"n_predict":50,"max_tokens":50}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := Inspect(c.kind, []byte(c.body), Options{})
			if err != nil {
				t.Fatalf("Inspect: %v", err)
			}
			if r.OutputTokens != c.out {
				t.Errorf("OutputTokens = %d, want %d", r.OutputTokens, c.out)
			}
			if string(r.Body) != c.want {
				t.Errorf("Inspect body\n got %s\nwant %s", r.Body, c.want)
			}
		})
	}
}
