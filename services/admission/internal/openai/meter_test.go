package openai

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"strings"
	"testing"
)

// event is one server-sent event as an upstream writes it.
func event(lines ...string) string { return strings.Join(lines, "\n") + "\n\n" }

func data(v string) string { return event("data: " + v) }

// Streams as OpenAI and OpenAI-compatible servers send them.
var (
	chatUsage = data(`{"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
	chatHead  = data(`{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}`) +
		data(`{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}],"usage":null}`) +
		": keep-alive\n\n" +
		data(`{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" world, ça va?"},"finish_reason":null}],"usage":null}`) +
		data(`{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}`)
	done = "data: [DONE]\n\n"

	completionsUsage = data(`{"id":"x","object":"text_completion","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}`)
	completionsHead  = data(`{"id":"x","object":"text_completion","choices":[{"text":"Once","index":0,"finish_reason":null}]}`) +
		data(`{"id":"x","object":"text_completion","choices":[{"text":" upon a","index":0,"finish_reason":"length"}]}`)

	legacyAndAudio = data(`{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"function_call":{"name":"get_weather","arguments":""}}}]}`) +
		data(`{"choices":[{"index":0,"delta":{"function_call":{"arguments":"{\"city\": \"Paris\"}"}}}]}`) +
		data(`{"choices":[{"index":1,"delta":{"role":"assistant","audio":{"id":"a1","transcript":"Hello there","data":"UklGRiQAAABXQVZF"}}}]}`) +
		data(`{"choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}`)

	responses = event("event: response.created", `data: {"type":"response.created","response":{"id":"r1","status":"in_progress","usage":null}}`) +
		event("event: response.output_text.delta", `data: {"type":"response.output_text.delta","output_index":0,"content_index":0,"delta":"Hi"}`) +
		event("event: response.output_text.delta", `data: {"type":"response.output_text.delta","output_index":0,"content_index":0,"delta":" there"}`) +
		event("event: response.output_text.done", `data: {"type":"response.output_text.done","output_index":0,"text":"Hi there"}`) +
		event("event: response.completed", `data: {"type":"response.completed","response":{"id":"r1","status":"completed","usage":{"input_tokens":12,"output_tokens":2,"total_tokens":14}}}`)
)

type meterCase struct {
	name   string
	kind   Kind
	strip  bool
	stream string
	want   string // forwarded
	usage  Usage
	report bool
}

func meterCases(t *testing.T) []meterCase {
	text := func(s string) int64 { return tok(t, o200k, s) }
	crlf := func(s string) string { return strings.ReplaceAll(s, "\n", "\r\n") }
	cr := func(s string) string { return strings.ReplaceAll(s, "\n", "\r") }
	return []meterCase{
		{"chat, usage stripped", Chat, true, chatHead + chatUsage + done, chatHead + done, Usage{9, 2}, true},
		{"chat, client asked for usage", Chat, false, chatHead + chatUsage + done, chatHead + chatUsage + done, Usage{9, 2}, true},
		{"chat CRLF, usage stripped", Chat, true, crlf(chatHead + chatUsage + done), crlf(chatHead + done), Usage{9, 2}, true},
		{"chat CR, usage stripped", Chat, true, cr(chatHead + chatUsage + done), cr(chatHead + done), Usage{9, 2}, true},
		{"chat, no usage: counted", Chat, true, chatHead + done, chatHead + done, Usage{0, text("Hello world, ça va?")}, false},
		{"chat cut midway: counted", Chat, true, chatHead[:len(chatHead)-40], chatHead[:len(chatHead)-40], Usage{0, text("Hello world, ça va?")}, false},
		{"usage on a chunk with choices is kept", Chat, true,
			data(`{"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}`) + done,
			data(`{"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}`) + done,
			Usage{5, 1}, true},
		{"a null usage is not a usage chunk", Chat, true, data(`{"choices":[],"usage":null}`) + done, data(`{"choices":[],"usage":null}`) + done, Usage{}, false},
		{"n=2 and tool calls counted per choice", Chat, true,
			data(`{"choices":[{"index":0,"delta":{"content":"Hello"}},{"index":1,"delta":{"content":"Good"}}]}`) +
				data(`{"choices":[{"index":1,"delta":{"content":"bye"}},{"index":0,"delta":{"content":" there"}}]}`) +
				data(`{"choices":[{"index":2,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"get","arguments":"{\"a\":"}}]}}]}`) +
				data(`{"choices":[{"index":2,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}`),
			data(`{"choices":[{"index":0,"delta":{"content":"Hello"}},{"index":1,"delta":{"content":"Good"}}]}`) +
				data(`{"choices":[{"index":1,"delta":{"content":"bye"}},{"index":0,"delta":{"content":" there"}}]}`) +
				data(`{"choices":[{"index":2,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"get","arguments":"{\"a\":"}}]}}]}`) +
				data(`{"choices":[{"index":2,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}`),
			Usage{0, text("Hello there") + text("Goodbye") + text(`get{"a":1}`)}, false},
		// Without them a stream cut before its usage counts 0: released.
		{"legacy function_call and audio transcript counted", Chat, true, legacyAndAudio, legacyAndAudio,
			Usage{0, text(`get_weather{"city": "Paris"}`) + text("Hello there")}, false},
		{"completions, usage stripped", Completions, true, completionsHead + completionsUsage + done, completionsHead + done, Usage{4, 3}, true},
		{"completions, no usage: counted", Completions, false, completionsHead + done, completionsHead + done, Usage{0, text("Once upon a")}, false},
		{"responses: usage in response.completed", Responses, true, responses, responses, Usage{12, 2}, true},
		{"responses cut: counted", Responses, false, responses[:strings.Index(responses, "event: response.output_text.done")],
			responses[:strings.Index(responses, "event: response.output_text.done")], Usage{0, text("Hi there")}, false},
		{"responses CRLF", Responses, false, crlf(responses), crlf(responses), Usage{12, 2}, true},
	}
}

// feed runs a stream through a new Meter in the given chunks and returns
// what it forwarded, Flush included.
func feed(c meterCase, chunks ...string) (string, *Meter) {
	m := NewMeter(c.kind, "gpt-4o", c.strip)
	var out bytes.Buffer
	for _, ch := range chunks {
		out.Write(m.Feed([]byte(ch)))
	}
	out.Write(m.Flush())
	return out.String(), m
}

// TestMeter feeds each stream whole, split at every byte boundary and a
// byte at a time: the client gets the same bytes and the usage is the same.
func TestMeter(t *testing.T) {
	for _, c := range meterCases(t) {
		t.Run(c.name, func(t *testing.T) {
			check := func(how string, chunks ...string) {
				t.Helper()
				got, m := feed(c, chunks...)
				if got != c.want {
					t.Fatalf("%s: forwarded\n%q\nwant\n%q", how, got, c.want)
				}
				if u, rep := m.Usage(); u != c.usage || rep != c.report {
					t.Fatalf("%s: Usage() = %v, %v; want %v, %v", how, u, rep, c.usage, c.report)
				}
				if u, rep := m.Usage(); u != c.usage || rep != c.report {
					t.Fatalf("%s: second Usage() = %v, %v; want %v, %v", how, u, rep, c.usage, c.report)
				}
			}
			check("whole", c.stream)
			for i := 1; i < len(c.stream); i++ {
				check("split at "+strconv.Itoa(i), c.stream[:i], c.stream[i:])
			}
			check("byte by byte", strings.Split(c.stream, "")...)
		})
	}
}

// TestMeterForwardsAtOnce: without stripping, Feed returns its input
// itself, and with stripping, a complete event is forwarded in the Feed that
// completes its data line: nothing waits for a later chunk.
func TestMeterForwardsAtOnce(t *testing.T) {
	m := NewMeter(Chat, "gpt-4o", false)
	p := []byte(chatHead[:10])
	if got := m.Feed(p); &got[0] != &p[0] || len(got) != len(p) {
		t.Errorf("Feed without stripping returned a copy")
	}
	m = NewMeter(Chat, "gpt-4o", true)
	first := data(`{"choices":[{"index":0,"delta":{"content":"Hi"}}]}`)
	if got := string(m.Feed([]byte(first[:len(first)-1]))); got != first[:len(first)-1] {
		t.Errorf("Feed(an event less its blank line) = %q, want it all", got)
	}
	if got := string(m.Feed([]byte("\n: ping"))); got != "\n" {
		t.Errorf("Feed(blank line, start of a comment) = %q, want the blank line", got)
	}
}

// chunked cuts s into chunks of n bytes.
func chunked(s string, n int) []string {
	chunks := make([]string, 0, len(s)/n+1)
	for i := 0; i < len(s); i += n {
		chunks = append(chunks, s[i:min(i+n, len(s))])
	}
	return chunks
}

// TestMeterBounded: a line longer than maxLine passes through whole, its
// usage read, and the Meter's buffers stay bounded.
func TestMeterBounded(t *testing.T) {
	long := "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1},\"pad\":\"" + strings.Repeat("x", maxLine) + "\"}\n\n"
	c := meterCase{kind: Chat, strip: true}
	got, m := feed(c, chunked(long, 4096)...)
	if got != long {
		t.Errorf("a %d-byte line was not forwarded whole (%d bytes)", len(long), len(got))
	}
	if u, rep := m.Usage(); !rep || u != (Usage{1, 1}) {
		t.Errorf("Usage() = %v, %v from a line past maxLine, want {1 1}, true", u, rep)
	}
	if cap(m.line) > 2*maxLine || cap(m.hold) > 2*maxLine {
		t.Errorf("buffers grew to %d and %d bytes", cap(m.line), cap(m.hold))
	}
	var s strings.Builder
	const deltas, text = 3 * textBuffer / 20, "word word word word" // 4 tokens
	for range deltas {
		s.WriteString(data(`{"choices":[{"index":0,"delta":{"content":"` + text + `"}}]}`))
	}
	_, m = feed(meterCase{kind: Chat}, s.String())
	if m.buffered > textBuffer {
		t.Errorf("%d bytes of text kept, want at most %d", m.buffered, textBuffer)
	}
	// Past exactBytes the text counts at least minTokensPerByte.
	most := int64(deltas*len(text)/DefaultBytesPerToken) + 1
	if u, _ := m.Usage(); u.Output < deltas*4 || u.Output > most {
		t.Errorf("Usage().Output = %d, want from %d to %d", u.Output, deltas*4, most)
	}
}

// TestMeterScansLongLines: the usage of a data line past maxLine is read
// (a response.completed echoes the caller's instructions, whose length the
// caller sets), from its place alone: not from a string's text, a deeper
// object, an event that does not settle, a line cut short or not data.
func TestMeterScansLongLines(t *testing.T) {
	pad := strings.Repeat("x", maxLine)
	// What the caller wrote, echoed: a fake usage and JSON's punctuation in a string.
	instructions := `"\"usage\":{\"input_tokens\":1,\"output_tokens\":1}}]} \\` + pad + `"`
	completed := func(typ, usage string) string {
		return `data: {"type":"` + typ + `","response":{"id":"r","instructions":` + instructions +
			`,"output":[{"type":"message","usage":{"input_tokens":2,"output_tokens":2}}],"metadata":{"usage":{"input_tokens":3,"output_tokens":3}},` +
			`"usage":` + usage + `}}`
	}
	const reported = `{"input_tokens":200000,"output_tokens":30000,"output_tokens_details":{"reasoning_tokens":29990}}`
	for _, c := range []struct {
		name, line string
		usage      Usage
		report     bool
	}{
		{"response.completed", completed("response.completed", reported), Usage{200000, 30000}, true},
		{"response.incomplete", completed("response.incomplete", reported), Usage{200000, 30000}, true},
		{"an event that does not settle", completed("response.in_progress", reported), Usage{}, false},
		{"a line cut short", strings.TrimSuffix(completed("response.completed", reported), "}}"), Usage{}, false},
		{"not a data line", ": " + completed("response.completed", reported), Usage{}, false},
		{"a usage past maxUsageObject", completed("response.completed", `{"input_tokens":1,"output_tokens":1,"pad":"`+pad[:maxUsageObject]+`"}`), Usage{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			stream := event("event: x", c.line)
			for _, n := range []int{len(stream), 4096, 999} {
				got, m := feed(meterCase{kind: Responses}, chunked(stream, n)...)
				if got != stream {
					t.Fatalf("chunks of %d: %d bytes forwarded, want %d", n, len(got), len(stream))
				}
				if u, rep := m.Usage(); u != c.usage || rep != c.report {
					t.Errorf("chunks of %d: Usage() = %v, %v; want %v, %v", n, u, rep, c.usage, c.report)
				}
			}
		})
	}
}

// FuzzMeter feeds arbitrary streams in arbitrary chunks: Feed never panics,
// forwards the same bytes and finds the same usage however the stream is
// split, and forwards exactly the stream less its usage chunks (events
// whose first data line has "choices": [] and a usage) when stripping, the
// stream itself otherwise. Seeds live in testdata/fuzz/FuzzMeter.
func FuzzMeter(f *testing.F) {
	f.Fuzz(func(t *testing.T, kind uint8, strip bool, stream []byte, cuts []byte) {
		c := meterCase{kind: Kind(kind%4 + 1), strip: strip}
		whole, m := feed(c, string(stream))
		u, rep := m.Usage()
		var chunks []string
		rest := string(stream)
		for _, n := range cuts {
			n := int(n) % (len(rest) + 1)
			chunks = append(chunks, rest[:n])
			rest = rest[n:]
		}
		split, m2 := feed(c, append(chunks, rest)...)
		if split != whole {
			t.Fatalf("split %v: forwarded %q, whole %q", cuts, split, whole)
		}
		if u2, rep2 := m2.Usage(); u2 != u || rep2 != rep {
			t.Fatalf("split %v: Usage() = %v, %v; whole %v, %v", cuts, u2, rep2, u, rep)
		}
		if want := withoutUsageChunks(string(stream), c.strip && (c.kind == Chat || c.kind == Completions)); whole != want {
			t.Fatalf("forwarded %q, want %q", whole, want)
		}
		if u.Input < 0 || u.Output < 0 {
			t.Fatalf("Usage() = %v", u)
		}
	})
}

// withoutUsageChunks is the reference for what a stripping Meter forwards:
// the stream cut into lines (LF, CRLF or CR) and events (ended by a blank
// line), less each event whose first data line is a usage chunk.
func withoutUsageChunks(s string, strip bool) string {
	if !strip {
		return s
	}
	var out, ev strings.Builder
	decided, dropped := false, false
	for s != "" {
		i := strings.IndexAny(s, "\r\n")
		if i < 0 {
			ev.WriteString(s) // an unterminated line: held, then flushed
			break
		}
		n := 1
		if s[i] == '\r' && i+1 < len(s) && s[i+1] == '\n' {
			n = 2
		}
		line := s[:i]
		ev.WriteString(s[:i+n])
		s = s[i+n:]
		if v, ok := strings.CutPrefix(line, "data:"); ok && !decided {
			decided = true
			var c streamChunk
			if json.Unmarshal([]byte(strings.TrimPrefix(v, " ")), &c) == nil && c.Choices != nil && len(c.Choices) == 0 {
				_, dropped = usageIn(Chat, c.Usage)
			}
		}
		if line == "" {
			if !dropped {
				out.WriteString(ev.String())
			}
			ev.Reset()
			decided, dropped = false, false
		}
	}
	if !dropped {
		out.WriteString(ev.String())
	}
	return out.String()
}

// TestMeterCountsLongLines: the text of a data line past maxLine, which
// passes through unread, is counted (at least a token per 3 bytes) when
// no usage comes: a cut stream whose only delta is 2 MiB long is not
// charged 0. Each line puts its text where read() takes it from; text
// elsewhere (an id, audio's base64) counts nothing, and a usage on the
// long line is charged as reported.
func TestMeterCountsLongLines(t *testing.T) {
	const n = 2 << 20
	text := strings.Repeat(`ab\"`, n/3) + "ab" // n bytes decoded, a third more on the wire
	least := int64(math.Ceil(n / DefaultBytesPerToken))
	for _, c := range []struct {
		name string
		kind Kind
		line string
		want int64 // the output charged, ⌈n / 3⌉, or 0: at most 2
	}{
		{"content", Chat, `{"choices":[{"index":0,"delta":{"content":"` + text + `"}}]}`, least},
		{"refusal", Chat, `{"choices":[{"index":0,"delta":{"refusal":"` + text + `"}}]}`, least},
		{"reasoning_content", Chat, `{"choices":[{"index":0,"delta":{"reasoning_content":"` + text + `"}}]}`, least},
		{"reasoning", Chat, `{"choices":[{"index":0,"delta":{"reasoning":"` + text + `"}}]}`, least},
		{"tool-call arguments", Chat, `{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"` + text + `"}}]}}]}`, least},
		{"tool-call name", Chat, `{"choices":[{"index":1,"delta":{"tool_calls":[{},{"function":{"name":"` + text + `"}}]}}]}`, least},
		{"function_call arguments", Chat, `{"choices":[{"index":0,"delta":{"function_call":{"arguments":"` + text + `"}}}]}`, least},
		{"function_call name", Chat, `{"choices":[{"index":0,"delta":{"function_call":{"name":"` + text + `"}}}]}`, least},
		{"audio transcript", Chat, `{"choices":[{"index":0,"delta":{"audio":{"data":"AAAA","transcript":"` + text + `"}}}]}`, least},
		{"completions text", Completions, `{"choices":[{"text":"` + text + `","index":0}]}`, least},
		{"responses output_text delta", Responses, `{"delta":"` + text + `","type":"response.output_text.delta","output_index":0}`, least},
		{"responses arguments delta", Responses, `{"type":"response.function_call_arguments.delta","delta":"` + text + `"}`, least},
		{"audio data", Chat, `{"choices":[{"index":0,"delta":{"audio":{"data":"` + text + `"}}}]}`, 0},
		{"an id", Chat, `{"id":"` + text + `","choices":[{"index":0,"delta":{"content":"x"}}]}`, 0},
		{"a key, not a value", Chat, `{"choices":[{"index":0,"delta":{"` + text + `":"content"}}]}`, 0},
		{"responses audio delta", Responses, `{"type":"response.audio.delta","delta":"` + text + `"}`, 0},
		{"responses event that streams no text", Responses, `{"type":"response.created","delta":"` + text + `"}`, 0},
		{"a line cut short", Chat, `{"choices":[{"index":0,"delta":{"content":"` + text + `"`, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			stream := event("data: "+c.line) + ": the upstream failed\n\n"
			got, m := feed(meterCase{kind: c.kind, strip: true}, chunked(stream, 32<<10)...)
			if got != stream {
				t.Fatalf("%d bytes forwarded, want %d", len(got), len(stream))
			}
			u, rep := m.Usage()
			// Nothing else was tokenized: the floor rate, each escape
			// counted as the bytes it stands for.
			if rep || c.want > 0 && (u.Output < c.want || u.Output > c.want+2) || c.want == 0 && u.Output > 2 {
				t.Errorf("Usage() = %v, %v; want output %d (0: at most 2), unreported", u, rep, c.want)
			}
		})
	}
	t.Run("with a usage", func(t *testing.T) {
		line := `{"choices":[{"index":0,"delta":{"content":"` + text + `"}}],"usage":{"prompt_tokens":7,"completion_tokens":9}}`
		_, m := feed(meterCase{kind: Chat}, chunked(event("data: "+line), 32<<10)...)
		if u, rep := m.Usage(); !rep || u != (Usage{7, 9}) {
			t.Errorf("Usage() = %v, %v; want {7 9} as reported", u, rep)
		}
	})
}
