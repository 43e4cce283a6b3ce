package main

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"quotaflow/services/admission/internal/openai"
)

// BenchmarkLLMGateway is one streamed chat completion, sequential, to the
// stand-in LLM directly and through the gateway (identify, count tokens,
// admit on the real Redis, forward, meter, publish the actual event to the
// real NATS), in one run so both see the machine's state, beside one POST
// /v1/admit (the decision the gateway waits for before the first byte
// goes upstream, on the same Redis). It reports:
//
//   - ttft-us: the median time from sending the request to reading the
//     first content chunk (time to first token);
//   - total-us: the median time to the stream's end;
//   - cpu-us/op: this process's CPU (utime + stime, as /proc/self/stat
//     counts it) per request: client and stand-in in both, plus the
//     gateway through it, so the difference is the gateway's CPU.
//
// go test -run '^$' -bench LLMGateway -count 6 ./services/admission/
func BenchmarkLLMGateway(b *testing.B) {
	g, body := newGatewayBench(b)
	b.Run("admit", func(b *testing.B) {
		i := 0
		start := time.Now()
		for b.Loop() {
			i++
			if a := g.admit("alice", fmt.Sprint("admit-", i), 100); a.code != 200 {
				b.Fatalf("POST /v1/admit = %d", a.code)
			}
		}
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "admit-us")
	})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	for _, target := range []struct{ name, url, key string }{
		{"direct", g.up.URL, "upstream-secret"},
		{"gateway", g.srv.URL + "/v1", llmKey},
	} {
		b.Run(target.name, func(b *testing.B) {
			var ttft, total []time.Duration
			cpu0 := processCPU(b)
			for b.Loop() {
				first, end, err := streamOnce(client, target.url, target.key, body, time.Now())
				if err != nil {
					b.Fatal(err)
				}
				ttft, total = append(ttft, first), append(total, end)
			}
			cpu := processCPU(b) - cpu0
			b.ReportMetric(float64(median(ttft).Microseconds()), "ttft-us")
			b.ReportMetric(float64(median(total).Microseconds()), "total-us")
			b.ReportMetric(cpu*1e6/float64(b.N), "cpu-us/op")
		})
	}
}

func median(ds []time.Duration) time.Duration { return percentile(ds, 50) }

// newGatewayBench is the gateway benchmarks' stack, under a quota never
// reached, and their request: a streamed chat completion of 50 tokens. The
// vocabularies are loaded first, as run does, so none loads in a measured
// request.
func newGatewayBench(b *testing.B) (*gatewayStack, string) {
	g := newGatewayStack(b, `
default_plan: p
plans:
  p:
    quotas: [{name: tokens, kind: rolling, window: 24h, limit: 1000000000000}]
`)
	if err := openai.Warm(); err != nil {
		b.Fatal(err)
	}
	return g, chat(true, false, 50)
}
