package openai

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzUsageScan: fed any line in pieces of any size, a usageScan keeps at
// most maxUsageObject bytes and never panics; fed a JSON object, it finds
// exactly the object at its path, as decoding the whole line does, and
// nothing a string holds (an echoed "usage" in instructions) passes for it;
// fed any JSON, it counts the bytes its texts decode to, as
// encoding/json's tokens do.
func FuzzUsageScan(f *testing.F) {
	f.Add([]byte(`{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}`), false, uint16(7))
	f.Add([]byte(`{"type":"response.completed","response":{"instructions":"say \"usage\":{\"input_tokens\":1}","usage":{"input_tokens":9,"output_tokens":2}}}`), true, uint16(3))
	f.Add([]byte(`{"type":"response.completed","response":{"usage":null,"x":{"usage":{"input_tokens":1}}}}`), true, uint16(1))
	f.Add([]byte(`{"usage":{"a":[{"b":"}"}],"c":"\\"}}`), false, uint16(2))
	f.Add([]byte(`{"note":"a\"b","usage":{"x":1},"z":"\\"}`), false, uint16(9)) // escapes decide where strings end
	f.Add([]byte(`{"usage":[1,2],"more":{"usage":{"a":1}}}`), false, uint16(5))
	f.Add([]byte(`{"usage":{"a":1}`), false, uint16(4)) // cut short
	f.Add([]byte(`]`), false, uint16(1))
	f.Add([]byte(`{"choices":[{"text":"\u00e9\ud83d\ude00\"","delta":{"content":"a\\","tool_calls":[{},{"function":{"arguments":"{\"a\":1}","x":"y"}}]}}],"content":"no"}`), false, uint16(5))
	f.Add([]byte(`{"delta":"\u4e2d\n","choices":[{"delta":{"content":"no"}}],"type":"response.output_text.delta"}`), true, uint16(3))
	f.Add([]byte(`{"choices":[{"delta":{"content":["no"],"reasoning":"\u12"}}]}`), false, uint16(2))
	f.Fuzz(func(t *testing.T, line []byte, responses bool, piece uint16) {
		kind := Chat
		if responses {
			kind = Responses
		}
		s := newUsageScan(kind)
		step := int(piece)%64 + 1
		for b := line; len(b) > 0; b = b[min(step, len(b)):] {
			s.feed(b[:min(step, len(b))])
		}
		if len(s.usage) > maxUsageObject {
			t.Fatalf("kept %d bytes, more than %d", len(s.usage), maxUsageObject)
		}
		if want, ok := textBytes(line, s.texts); ok && s.text.n != want {
			t.Fatalf("scan of %q: %d bytes of text, want %d", line, s.text.n, want)
		}
		path := s.path
		var doc map[string]json.RawMessage
		if !json.Valid(line) || json.Unmarshal(line, &doc) != nil || len(line) > maxUsageObject ||
			bytes.Count(line, []byte(`"usage"`)) > 1 || bytes.Count(line, []byte(`"response"`)) > 1 {
			return // not JSON, or a key named twice (decoding keeps the last)
		}
		want := doc[path[0]]
		if responses {
			var inner map[string]json.RawMessage
			if json.Unmarshal(want, &inner) != nil {
				want = nil
			} else {
				want = inner[path[1]]
			}
		}
		isObject := len(want) > 0 && want[0] == '{'
		if !s.complete() || s.found != isObject || isObject && !bytes.Equal(s.usage, want) {
			t.Fatalf("scan of %q: complete %v, found %v %q; want %q", line, s.complete(), s.found, s.usage, want)
		}
	})
}

// textBytes is the length of the strings at paths in line, decoded by
// encoding/json: false when line is not JSON or one of them holds U+FFFD
// (what a lone surrogate or invalid UTF-8 decodes to, whose bytes the scan
// counts as they come).
func textBytes(line []byte, paths [][]string) (int, bool) {
	type frame struct {
		obj, wantKey bool
		key          string
	}
	var stack []frame
	at := func() bool { // a value here is at one of paths
		for _, p := range paths {
			if len(p) != len(stack) {
				continue
			}
			match := true
			for i, f := range stack {
				match = match && (f.obj && f.key == p[i] || !f.obj && p[i] == "*")
			}
			if match {
				return true
			}
		}
		return false
	}
	d := json.NewDecoder(bytes.NewReader(line))
	n := 0
	for {
		tok, err := d.Token()
		if err == io.EOF {
			return n, true
		}
		if err != nil {
			return 0, false
		}
		top := len(stack) - 1
		switch v := tok.(type) {
		case json.Delim:
			if v == '{' || v == '[' {
				stack = append(stack, frame{obj: v == '{', wantKey: v == '{'})
				continue
			}
			stack, top = stack[:top], top-1
		case string:
			if top >= 0 && stack[top].wantKey {
				stack[top].key, stack[top].wantKey = v, false
				continue
			}
			if at() {
				if strings.ContainsRune(v, utf8.RuneError) {
					return 0, false
				}
				n += len(v)
			}
		}
		if top >= 0 && stack[top].obj {
			stack[top].wantKey = true // a value ended
		}
	}
}
