package openai

import (
	"testing"

	"quotaflow/pkg/limits"
)

func TestUsageOf(t *testing.T) {
	cases := []struct {
		name string
		kind Kind
		body string
		want Usage
		ok   bool
	}{
		{"chat", Chat, `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],` +
			`"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"completion_tokens_details":{"reasoning_tokens":0}}}`, Usage{9, 12}, true},
		{"completions", Completions, `{"object":"text_completion","choices":[{"text":"x","index":0}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}`, Usage{5, 7}, true},
		{"embeddings", Embeddings, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1]}],"usage":{"prompt_tokens":8,"total_tokens":8}}`, Usage{8, 0}, true},
		{"responses", Responses, `{"id":"resp_1","object":"response","status":"completed","output":[],"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},"output_tokens":87,"total_tokens":123}}`, Usage{36, 87}, true},
		{"zero output", Chat, `{"usage":{"prompt_tokens":3,"completion_tokens":0}}`, Usage{3, 0}, true},
		{"error body", Chat, `{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}`, Usage{}, false},
		{"usage null", Chat, `{"choices":[],"usage":null}`, Usage{}, false},
		{"chat names on responses", Responses, `{"usage":{"prompt_tokens":1,"completion_tokens":2}}`, Usage{}, false},
		{"no output count", Chat, `{"usage":{"prompt_tokens":1}}`, Usage{}, false},
		{"negative", Chat, `{"usage":{"prompt_tokens":-1,"completion_tokens":2}}`, Usage{}, false},
		{"fraction", Chat, `{"usage":{"prompt_tokens":1.5,"completion_tokens":2}}`, Usage{}, false},
		{"string", Chat, `{"usage":{"prompt_tokens":"1","completion_tokens":2}}`, Usage{}, false},
		{"beyond 1e12", Chat, `{"usage":{"prompt_tokens":1000000000001,"completion_tokens":2}}`, Usage{}, false},
		{"case differs", Chat, `{"Usage":{"prompt_tokens":1,"completion_tokens":2}}`, Usage{}, false},
		{"repeated usage", Chat, `{"usage":{"prompt_tokens":1,"completion_tokens":2},"usage":{"prompt_tokens":9,"completion_tokens":9}}`, Usage{}, false},
		{"not json", Chat, `data: {"usage":{}}`, Usage{}, false},
		{"empty", Chat, ``, Usage{}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if u, ok := UsageOf(c.kind, []byte(c.body)); u != c.want || ok != c.ok {
				t.Errorf("UsageOf(%v, %s) = %v, %v; want %v, %v", c.kind, c.body, u, ok, c.want, c.ok)
			}
		})
	}
	if maxUsage != limits.MaxCost {
		t.Errorf("maxUsage = %v, want limits.MaxCost %v", maxUsage, limits.MaxCost)
	}
}

// FuzzUsageOf: UsageOf never panics, and what it reports is within bounds.
// Seeds live in testdata/fuzz/FuzzUsageOf.
func FuzzUsageOf(f *testing.F) {
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		k := Kind(kind%4 + 1)
		u, ok := UsageOf(k, body)
		if !ok && u != (Usage{}) || u.Input < 0 || u.Output < 0 || u.Input > maxUsage || u.Output > maxUsage || k == Embeddings && u.Output != 0 {
			t.Fatalf("UsageOf(%v, %q) = %v, %v", k, body, u, ok)
		}
	})
}
