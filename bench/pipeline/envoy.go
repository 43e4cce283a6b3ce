package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"quotaflow/bench/internal/envoy"
	"quotaflow/bench/internal/load"
	"quotaflow/internal/e2e"
)

// peer is a running ratelimit service on a redis-server of its own.
type peer struct {
	svc   *e2e.Service
	redis *e2e.Server
	addr  string // its HTTP host:port, serving POST /json
}

// startEnvoy runs bin, set up by envoy.Setup, on a TCP redis-server of
// its own with the pool the peer is fastest with.
func startEnvoy(ctx context.Context, dir, bin string) (*peer, error) {
	dir = filepath.Join(dir, "envoy")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	e := &peer{}
	var err error
	if e.redis, err = e2e.StartRedis(ctx, dir); err != nil {
		return e, err
	}
	env, addr, err := envoy.Setup(dir, e.redis.Addr, envoy.DefaultPoolSize, 0)
	if err != nil {
		return e, err
	}
	e.addr = addr
	// No ops address: its readiness is a check answered OK.
	if e.svc, err = e2e.Start("ratelimit", bin, dir, "", env); err != nil {
		return e, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := envoy.Check(addr)
		if err == nil {
			return e, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return e, fmt.Errorf("ratelimit does not answer on %s (%v); log:\n%s", addr, err, e2e.Tail(e.svc.LogPath, 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (e *peer) close() {
	if e.svc != nil {
		_ = e.svc.Stop(10 * time.Second)
	}
	if e.redis != nil {
		e.redis.Close()
	}
}

// peerRound is what one measured round of envoy did.
type peerRound struct {
	res *load.Result
	cpu []time.Duration // per meter, over the load
}

func (c peerRound) rate() float64 {
	return float64(c.res.Status[http.StatusOK]) / c.res.Elapsed.Seconds()
}

func (c peerRound) perCheck(i int) time.Duration {
	return c.cpu[i] / time.Duration(max(1, c.res.Status[http.StatusOK]))
}

// round loads envoy for d with checks of random users.
func (e *peer) round(ctx context.Context, ms []meter, conns, users int, d time.Duration) (peerRound, error) {
	cpu0, err := read(ms)
	if err != nil {
		return peerRound{}, err
	}
	res, err := load.Run(ctx, load.Config{
		Addr: e.addr, Conns: conns, Duration: d,
		NewClient: load.Users(load.NewPost(e.addr, "/json"), users, envoy.Body),
	})
	if err != nil {
		return peerRound{}, err
	}
	cpu1, err := read(ms)
	if err != nil {
		return peerRound{}, err
	}
	c := peerRound{res: res}
	for i := range cpu1 {
		c.cpu = append(c.cpu, cpu1[i]-cpu0[i])
	}
	return c, nil
}
