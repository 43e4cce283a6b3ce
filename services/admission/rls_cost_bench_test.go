package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
)

// BenchmarkShouldRateLimitRequestID is what correlating a request's two
// calls costs: per op, a final call without a request id ("final"), or a
// request's two calls with one ("estimate_actual": the estimate, then the
// actual that corrects it), one descriptor each, 10k users, from
// b.RunParallel's goroutines over one connection. On a private
// redis-server, so that its commands and CPU per op (INFO) are this
// benchmark's alone; proc-cpu-us/op is the test process's (admission and
// the client). Interleaved rounds: for i in 1 2 3; do go test -run '^$'
// -bench ShouldRateLimitRequestID -benchtime 3000x ./services/admission/; done.
func BenchmarkShouldRateLimitRequestID(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client()
	r := startRLSCost(b, "rlscostbench", func(c *Config) {
		c.RedisURL = "redis://" + srv.Addr + "/0"
		// The user limit of the tests' configuration, raised out of reach.
		conf, err := os.ReadFile(c.EnvoyRateLimitConfig)
		if err != nil {
			b.Fatal(err)
		}
		conf = []byte(strings.Replace(string(conf), "requests_per_unit: 3}", "requests_per_unit: 1000000000}", 1))
		if err := os.WriteFile(c.EnvoyRateLimitConfig, conf, 0o644); err != nil {
			b.Fatal(err)
		}
	})
	var n atomic.Int64
	send := func(b *testing.B, with func(string, uint64, ...string) *rlv3.RateLimitDescriptor, id string, user, hits int64) {
		kv := []string{"tenant", "bench", "user", "u" + strconv.FormatInt(user, 10)}
		d := desc(kv...)
		if with != nil {
			d = with(id, uint64(hits), kv...)
		}
		resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: []*rlv3.RateLimitDescriptor{d}})
		if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OK {
			b.Errorf("ShouldRateLimit = %v, %v", codesOf(resp), err) // not Fatal: RunParallel's goroutine
		}
	}
	for _, c := range []struct {
		name string
		op   func(b *testing.B, i int64)
	}{
		{"final", func(b *testing.B, i int64) { send(b, nil, "", i%10000, 1) }},
		{"estimate_actual", func(b *testing.B, i int64) {
			id := fmt.Sprint("b", i)
			send(b, withID, id, i%10000, 10)
			send(b, withActual, id, i%10000, 7)
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			before, cpu0 := redisStats(b, rdb), processCPU(b)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					c.op(b, n.Add(1))
				}
			})
			b.StopTimer()
			after, cpu1 := redisStats(b, rdb), processCPU(b)
			b.ReportMetric((cpu1-cpu0)*1e6/float64(b.N), "proc-cpu-us/op")
			b.ReportMetric(float64(after.calls-before.calls)/float64(b.N), "redis-cmds/op")
			b.ReportMetric((after.cpu-before.cpu)*1e6/float64(b.N), "redis-cpu-us/op")
		})
	}
}

// processCPU is the CPU seconds (user and system) this process used so
// far: admission and its gRPC client, both in the test binary.
func processCPU(b *testing.B) float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// redisCounters are a redis-server's commands run so far (those its
// scripts ran included: an FCALL of the reserve script is four) and CPU
// seconds used (user and system).
type redisCounters struct {
	calls int64
	cpu   float64
}

func redisStats(b *testing.B, rdb *redis.Client) redisCounters {
	b.Helper()
	info, err := rdb.Info(context.Background(), "commandstats", "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var c redisCounters
	for _, line := range strings.Split(info, "\r\n") {
		k, v, _ := strings.Cut(line, ":")
		switch {
		case strings.HasPrefix(k, "cmdstat_") && k != "cmdstat_info":
			calls, _, _ := strings.Cut(strings.TrimPrefix(v, "calls="), ",")
			n, _ := strconv.ParseInt(calls, 10, 64)
			c.calls += n
		case k == "used_cpu_user" || k == "used_cpu_sys":
			f, _ := strconv.ParseFloat(v, 64)
			c.cpu += f
		}
	}
	return c
}
