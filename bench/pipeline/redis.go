package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/stats"
)

// redisCalls are calls and the µs Redis spent executing them, by what was
// called: INFO commandstats' commands, or with the slowlog (-redis-calls)
// an FCALL by its function ("fcall reserve"). A script's own redis.call
// commands are counted apart too and inside the script's µs.
type redisCalls map[string]redisCall

type redisCall struct{ calls, usec int64 }

func (c redisCalls) sub(o redisCalls) redisCalls {
	out := redisCalls{}
	for k, v := range c {
		d := redisCall{v.calls - o[k].calls, v.usec - o[k].usec}
		if d.calls != 0 {
			out[k] = d
		}
	}
	return out
}

// commandStats reads INFO commandstats.
func commandStats(ctx context.Context, rdb *redis.Client) (redisCalls, error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, fmt.Errorf("redis commandstats: %w", err)
	}
	out := redisCalls{}
	for _, line := range strings.Split(info, "\n") {
		name, fields, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		var c redisCall
		for _, kv := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				c.calls = n
			case "usec":
				c.usec = n
			}
		}
		out[strings.TrimPrefix(name, "cmdstat_")] = c
	}
	return out, nil
}

// logEveryCall makes Redis's slowlog keep every call (its execution µs and
// first arguments), so that a round's FCALLs split by function. It costs
// Redis a little per call: figures of such a run compare only with each
// other.
func logEveryCall(ctx context.Context, rdb *redis.Client) error {
	if err := rdb.ConfigSet(ctx, "slowlog-max-len", "10000000").Err(); err != nil {
		return err
	}
	return rdb.ConfigSet(ctx, "slowlog-log-slower-than", "0").Err()
}

// slowCalls empties the slowlog and returns what it held by call.
func slowCalls(ctx context.Context, rdb *redis.Client) (redisCalls, error) {
	logs, err := rdb.SlowLogGet(ctx, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("redis slowlog: %w", err)
	}
	if err := rdb.Do(ctx, "SLOWLOG", "RESET").Err(); err != nil {
		return nil, err
	}
	out := redisCalls{}
	for _, l := range logs {
		if len(l.Args) == 0 {
			continue
		}
		name := strings.ToLower(l.Args[0])
		if (name == "fcall" || name == "fcall_ro") && len(l.Args) > 1 {
			name += " " + l.Args[1]
		}
		c := out[name]
		c.calls++
		c.usec += int64(l.Duration / time.Microsecond)
		out[name] = c
	}
	return out, nil
}

// redisReport prints Redis's calls and execution µs per accounted request,
// per call, median of the rounds; calls is which of a round's tallies.
func redisReport(out io.Writer, title string, rounds []round, calls func(r round) redisCalls) {
	names := map[string]bool{}
	for _, r := range rounds {
		for k := range calls(r) {
			names[k] = true
		}
	}
	if len(names) == 0 {
		return
	}
	fmt.Fprintf(out, "\n%s, medians of the rounds:\n\n", title)
	row(out, "call", "calls per accounted request", "µs per accounted request", "µs per call")
	row(out, "---", "---", "---", "---")
	for _, k := range slices.Sorted(maps.Keys(names)) {
		var n, us, per []float64
		for _, r := range rounds {
			c := calls(r)[k]
			n = append(n, r.perReport(c.calls))
			us = append(us, r.perReport(c.usec))
			per = append(per, float64(c.usec)/float64(max(1, c.calls)))
		}
		row(out, k, format(stats.Median(n)), format(stats.Median(us)), format(stats.Median(per)))
	}
}
