package openai

import (
	"encoding/json"
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
// Inspect of a typical chat request (tokenized with o200k_base, or the
// bytes fallback for an unknown model) beside a plain JSON decode of the
// same body, the least any proxy reading the body pays.
func BenchmarkInspect(b *testing.B) {
	if err := Warm(); err != nil {
		b.Fatal(err)
	}
	unknown := []byte(strings.Replace(string(chatBody), "gpt-4o", "llama-3.1-8b", 1))
	for _, c := range []struct {
		name string
		run  func() error
	}{
		{"json-decode", func() error { var v any; return json.Unmarshal(chatBody, &v) }},
		{"inspect-gpt-4o", func() error { _, err := Inspect(Chat, chatBody, Options{}); return err }},
		{"inspect-fallback", func() error { _, err := Inspect(Chat, unknown, Options{}); return err }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(chatBody)))
			b.ReportAllocs()
			cpu := cpuTime()
			for b.Loop() {
				if err := c.run(); err != nil {
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
					n = newCounter(model, 0).count(c.text)
				}
				reportCPU(b, cpu)
				b.ReportMetric(float64(newCounter("unknown", 0).count(c.text))/float64(n), "fallback/tokenizer")
			})
		}
	}
}
