package openai

import (
	"encoding/json"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// chatBody is a typical chat request: a system prompt and three turns,
// streamed, about 2 KB.
var chatBody = []byte(`{"model":"gpt-4o","stream":true,"temperature":0.2,"messages":[` +
	`{"role":"system","content":"You are a support assistant for an online bookshop. Answer in two or three sentences, cite the order number when there is one, and never promise a refund: say that a colleague will review the request within two working days. If the customer is rude, stay polite and factual."},` +
	`{"role":"user","content":"Hello, my order 48213 arrived yesterday but the second volume of the set is missing. The box was sealed and the packing slip lists both volumes. Can you send the missing one or should I return the whole set? I need it before the end of the month for a class I am teaching."},` +
	`{"role":"assistant","content":"I am sorry that order 48213 arrived without the second volume. I have asked the warehouse to check the packing record, and a colleague will review whether we send the missing volume or a replacement set within two working days."},` +
	`{"role":"user","content":"Thanks. One more thing: the invoice shows the old address in Lyon, but I moved to Grenoble in March and updated my account then. Will the replacement go to the new address, and can you correct the invoice so my employer can reimburse me? They need the address on the invoice to match my current one."},` +
	`{"role":"assistant","content":"The replacement will go to the Grenoble address now on your account. I have flagged the invoice for order 48213 so a colleague can issue a corrected copy with the new address; you will receive it by email."},` +
	`{"role":"user","content":"Perfect. Last question: if the second volume is out of stock, how long would a reprint take, and would I be able to cancel just that volume and keep the first one without paying a restocking fee?"}]}`)

// cpuTime is the process's CPU so far (user + system, every thread, the
// garbage collector's included): what a request costs the host, less
// noisy on a shared machine than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
}

// BenchmarkInspect is the gateway's cost before it can admit a request:
// Inspect of a typical chat request beside a plain JSON decode of the same
// body, the least any proxy reading the body pays. Each operation builds a
// new body, numbering its messages: "new" numbers all of them (no text
// counted before: a conversation's first request), "next-turn" only the
// last (the history was counted on the turn before), "fallback" is a model
// without an encoding (bytes ÷ 3).
func BenchmarkInspect(b *testing.B) {
	if err := Warm(); err != nil {
		b.Fatal(err)
	}
	parts := strings.Split(string(chatBody), `"content":"`)
	body := func(dst []byte, i int, all bool, model string) []byte {
		dst = append(dst[:0], strings.Replace(parts[0], "gpt-4o", model, 1)...)
		for j, p := range parts[1:] {
			dst = append(dst, `"content":"`...)
			if all || j == len(parts)-2 {
				dst = strconv.AppendInt(dst, int64(i), 10)
				dst = append(dst, ' ')
			}
			dst = append(dst, p...)
		}
		return dst
	}
	for _, c := range []struct {
		name, model string
		all         bool
		run         func([]byte) error
	}{
		{"json-decode", "gpt-4o", true, func(p []byte) error { var v any; return json.Unmarshal(p, &v) }},
		{"inspect-gpt-4o-new", "gpt-4o", true, func(p []byte) error { _, err := Inspect(Chat, p, Options{}); return err }},
		{"inspect-gpt-4o-next-turn", "gpt-4o", false, func(p []byte) error { _, err := Inspect(Chat, p, Options{}); return err }},
		{"inspect-fallback", "llama-3.1-8b", true, func(p []byte) error { _, err := Inspect(Chat, p, Options{}); return err }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(chatBody)))
			b.ReportAllocs()
			var p []byte
			i := 0
			cpu := cpuTime()
			for b.Loop() {
				i++
				p = body(p, i, c.all, c.model)
				if err := c.run(p); err != nil {
					b.Fatal(err)
				}
			}
			reportCPU(b, cpu)
		})
	}
}

// BenchmarkMeterFeed is the gateway's cost per streamed chunk: Meter.Feed
// of one content chunk (as OpenAI sends it, about 200 bytes) passing
// through or stripping, beside a plain JSON decode of the chunk's data.
func BenchmarkMeterFeed(b *testing.B) {
	chunk := []byte(data(`{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion.chunk","created":1741570283,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null}],"usage":null}`))
	payload := chunk[len("data: ") : len(chunk)-2]
	for _, c := range []struct {
		name string
		run  func(*Meter)
	}{
		{"json-decode", func(*Meter) { var v any; _ = json.Unmarshal(payload, &v) }},
		{"feed-pass", func(m *Meter) { m.Feed(chunk) }},
		{"feed-strip", func(m *Meter) { m.Feed(chunk) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			m := NewMeter(Chat, "gpt-4o", c.name == "feed-strip")
			b.SetBytes(int64(len(chunk)))
			b.ReportAllocs()
			cpu := cpuTime()
			for b.Loop() {
				c.run(m)
			}
			reportCPU(b, cpu)
		})
	}
}

// BenchmarkCount is the tokenizer's speed (MB/s) on the corpus's prose
// (the README), code (Go) and Chinese, and the bytes fallback's count
// against it (fallback/tokenizer: above 1 over-reserves).
func BenchmarkCount(b *testing.B) {
	corpus := readCorpus(b)
	code := strings.Index(corpus, "package decide")
	design := strings.Index(corpus, "# quotaflow — design")
	cjk := strings.Index(corpus, "配额流")
	for _, c := range []struct{ name, text string }{
		{"prose", corpus[:code]}, {"code", corpus[code:design]}, {"chinese", corpus[cjk:]},
	} {
		for _, model := range []string{"gpt-4o", "gpt-4"} {
			b.Run(c.name+"-"+model, func(b *testing.B) {
				b.SetBytes(int64(len(c.text)))
				var n int64
				cpu := cpuTime()
				for b.Loop() {
					counter := newCounter(model, 0)
					counter.cache = nil // the tokenizer's speed, not the cache's
					n = counter.count(c.text)
				}
				reportCPU(b, cpu)
				b.ReportMetric(float64(newCounter("unknown", 0).count(c.text))/float64(n), "fallback/tokenizer")
			})
		}
	}
}
