package openai

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzUsageScan: fed any line in pieces of any size, a usageScan keeps at
// most maxUsageObject bytes and never panics; fed a JSON object, it finds
// exactly the object at its path, as decoding the whole line does, and
// nothing a string holds (an echoed "usage" in instructions) passes for it.
func FuzzUsageScan(f *testing.F) {
	f.Add([]byte(`{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}`), false, uint16(7))
	f.Add([]byte(`{"type":"response.completed","response":{"instructions":"say \"usage\":{\"input_tokens\":1}","usage":{"input_tokens":9,"output_tokens":2}}}`), true, uint16(3))
	f.Add([]byte(`{"type":"response.completed","response":{"usage":null,"x":{"usage":{"input_tokens":1}}}}`), true, uint16(1))
	f.Add([]byte(`{"usage":{"a":[{"b":"}"}],"c":"\\"}}`), false, uint16(2))
	f.Add([]byte(`{"note":"a\"b","usage":{"x":1},"z":"\\"}`), false, uint16(9)) // escapes decide where strings end
	f.Add([]byte(`{"usage":[1,2],"more":{"usage":{"a":1}}}`), false, uint16(5))
	f.Add([]byte(`{"usage":{"a":1}`), false, uint16(4)) // cut short
	f.Add([]byte(`]`), false, uint16(1))
	f.Fuzz(func(t *testing.T, line []byte, responses bool, piece uint16) {
		path := []string{"usage"}
		if responses {
			path = []string{"response", "usage"}
		}
		s := &usageScan{path: path}
		step := int(piece)%64 + 1
		for b := line; len(b) > 0; b = b[min(step, len(b)):] {
			s.feed(b[:min(step, len(b))])
		}
		if len(s.usage) > maxUsageObject {
			t.Fatalf("kept %d bytes, more than %d", len(s.usage), maxUsageObject)
		}
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
