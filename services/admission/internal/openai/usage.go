package openai

import "encoding/json"

// Usage is what an upstream reports it used, in tokens.
type Usage struct {
	Input, Output int64
}

// maxUsage bounds a count read from an upstream: the engine's largest
// cost (limits.MaxCost, 1e12), far above any real response.
const maxUsage = 1e12

// UsageOf reads the usage of a non-streamed JSON response of endpoint k:
// usage.prompt_tokens and usage.completion_tokens (chat, completions;
// embeddings have no output), or usage.input_tokens and
// usage.output_tokens (responses). ok is false when the body has none
// (an error body) or a count is not a whole number from 0 to 1e12.
func UsageOf(k Kind, body []byte) (u Usage, ok bool) {
	o, err := parseObject(body)
	if err != nil {
		return Usage{}, false
	}
	return usageIn(k, o.value("usage"))
}

// usageIn reads a usage object of endpoint k (streams send "usage": null
// on every chunk but the last).
func usageIn(k Kind, raw []byte) (u Usage, ok bool) {
	if raw == nil || string(raw) == "null" {
		return Usage{}, false
	}
	o, err := parseObject(raw)
	if err != nil {
		return Usage{}, false
	}
	in, out := "prompt_tokens", "completion_tokens"
	switch k {
	case Responses:
		in, out = "input_tokens", "output_tokens"
	case Embeddings:
		out = ""
	}
	if u.Input, ok = count(o, in); !ok {
		return Usage{}, false
	}
	if out != "" {
		if u.Output, ok = count(o, out); !ok {
			return Usage{}, false
		}
	}
	return u, true
}

func count(o object, key string) (int64, bool) {
	var n int64
	v := o.value(key)
	if v == nil || json.Unmarshal(v, &n) != nil || n < 0 || n > maxUsage {
		return 0, false
	}
	return n, true
}
