package main

import (
	"bufio"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/services/admission/internal/openai"
)

// BenchmarkLLMGatewayLoad is BenchmarkLLMGateway's streamed chat completion
// under concurrent load: c clients in a closed loop (each sends its next
// request when its stream ended), directly to the stand-in and through the
// gateway, alternating within the run, b.N requests a round. It reports
// the added latency's percentiles over the round's requests:
//
//   - ttft-p50-us, ttft-p99-us: time to the first content chunk;
//   - total-p50-us, total-p99-us: time to the stream's end;
//   - cpu-us/op: this process's CPU per request (client and stand-in in
//     both, plus the gateway through it: the difference is the gateway's).
//
// go test -run '^$' -bench LLMGatewayLoad -benchtime 2000x -count 1 ./services/admission/
func BenchmarkLLMGatewayLoad(b *testing.B) {
	g := newGatewayStack(b, `
default_plan: p
plans:
  p:
    quotas: [{name: tokens, kind: rolling, window: 24h, limit: 1000000000000}]
`)
	body := chat(true, false, 50)
	if err := openai.Warm(); err != nil {
		b.Fatal(err)
	}
	for _, c := range []int{16, 64} {
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: c}}
		for _, target := range []struct{ name, url, key string }{
			{"direct", g.up.URL, "upstream-secret"},
			{"gateway", g.srv.URL + "/v1", llmKey},
		} {
			b.Run(fmt.Sprintf("c%d/%s", c, target.name), func(b *testing.B) {
				ttft, total := make([]time.Duration, b.N), make([]time.Duration, b.N)
				next := make(chan int, b.N)
				for i := range b.N {
					next <- i
				}
				close(next)
				cpu0 := processCPU(b)
				b.ResetTimer()
				var wg sync.WaitGroup
				for range c {
					wg.Go(func() {
						for i := range next {
							var err error
							if ttft[i], total[i], err = streamOnce(client, target.url, target.key, body); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				cpu := processCPU(b) - cpu0
				b.ReportMetric(float64(percentile(ttft, 50).Microseconds()), "ttft-p50-us")
				b.ReportMetric(float64(percentile(ttft, 99).Microseconds()), "ttft-p99-us")
				b.ReportMetric(float64(percentile(total, 50).Microseconds()), "total-p50-us")
				b.ReportMetric(float64(percentile(total, 99).Microseconds()), "total-p99-us")
				b.ReportMetric(cpu*1e6/float64(b.N), "cpu-us/op")
			})
		}
	}
}

// streamOnce sends one streamed chat completion and reads it to its end:
// the time to its first content chunk and to its end.
func streamOnce(client *http.Client, url, key, body string) (ttft, total time.Duration, err error) {
	req, _ := http.NewRequest("POST", url+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if ttft == 0 && strings.Contains(sc.Text(), `"content":" hello"`) {
			ttft = time.Since(start)
		}
	}
	total = time.Since(start)
	if resp.StatusCode != 200 || ttft == 0 {
		return 0, 0, fmt.Errorf("%s: status %d, no content chunk", url, resp.StatusCode)
	}
	return ttft, total, nil
}

// percentile is the p-th percentile of ds (the element at p% of the
// sorted count, the upper middle for the median).
func percentile(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}
