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
)

// BenchmarkLLMGatewayLoad is BenchmarkLLMGateway's streamed chat completion
// under concurrent load, directly to the stand-in and through the gateway,
// alternating within the run, b.N requests a round: 16 and 64 clients in a
// closed loop (each sends its next request when its stream ended: the
// throughput's limit, latency mostly queueing), and 500 requests a second
// due at fixed times (an open loop below saturation, each timed from when
// it was due so a stall is not hidden). It reports percentiles over the
// round's requests:
//
//   - ttft-p50-us, ttft-p99-us: time to the first content chunk;
//   - total-p50-us, total-p99-us: time to the stream's end;
//   - cpu-us/op: this process's CPU per request (client and stand-in in
//     both, plus the gateway through it: the difference is the gateway's).
//
// go test -run '^$' -bench LLMGatewayLoad -benchtime 2000x -count 1 ./services/admission/
func BenchmarkLLMGatewayLoad(b *testing.B) {
	g, body := newGatewayBench(b)
	for _, load := range []struct {
		name        string
		conns, rate int // rate 0: closed loop of conns clients
	}{
		{"c16", 16, 0}, {"c64", 64, 0}, {"rate500", 256, 500},
	} {
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: load.conns}}
		for _, target := range []struct{ name, url, key string }{
			{"direct", g.up.URL, "upstream-secret"},
			{"gateway", g.srv.URL + "/v1", llmKey},
		} {
			b.Run(load.name+"/"+target.name, func(b *testing.B) {
				ttft, total := make([]time.Duration, b.N), make([]time.Duration, b.N)
				due := make([]time.Time, b.N) // open loop: when request i is due, latency counting from there
				next := make(chan int, b.N)
				cpu0 := processCPU(b)
				b.ResetTimer()
				var wg sync.WaitGroup
				for range load.conns {
					wg.Go(func() {
						for i := range next {
							from := due[i]
							if from.IsZero() {
								from = time.Now()
							}
							var err error
							if ttft[i], total[i], err = streamOnce(client, target.url, target.key, body, from); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				start := time.Now()
				for i := range b.N {
					if load.rate > 0 { // a late request is late from its due time
						due[i] = start.Add(time.Duration(i) * time.Second / time.Duration(load.rate))
						time.Sleep(time.Until(due[i]))
					}
					next <- i
				}
				close(next)
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
// the time from start to its first content chunk and to its end.
func streamOnce(client *http.Client, url, key, body string, start time.Time) (ttft, total time.Duration, err error) {
	req, _ := http.NewRequest("POST", url+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
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
