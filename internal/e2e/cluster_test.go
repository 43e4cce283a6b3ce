package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redisconn"
)

// TestStartRedisCluster starts three masters and reaches them the way the
// services do, through ClusterURL and redisconn: the URL opens a cluster
// client, the three masters share every slot, and keys of many hash tags
// land on all three.
func TestStartRedisCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nodes, err := StartRedisCluster(ctx, t.TempDir(), 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		t.Cleanup(n.Close)
	}
	c, err := redisconn.Open(ClusterURL(nodes))
	if err != nil {
		t.Fatalf("redisconn.Open(%s): %v", ClusterURL(nodes), err)
	}
	defer c.Close()
	cc, ok := c.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("redisconn.Open(%s) = %T, want a cluster client", ClusterURL(nodes), c)
	}
	if got := len(cc.Options().Addrs); got != 3 {
		t.Errorf("ClusterURL seeds %d nodes, want 3", got)
	}
	slots, err := cc.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	covered := 0
	for _, s := range slots {
		covered += s.End - s.Start + 1
	}
	if len(slots) != 3 || covered != 16384 {
		t.Errorf("CLUSTER SLOTS: %d ranges covering %d slots, want 3 covering 16384", len(slots), covered)
	}
	for i := range 64 {
		if err := cc.Set(ctx, fmt.Sprintf("{t%d}:k", i), i, time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range nodes {
		rc := redis.NewClient(&redis.Options{Addr: n.Addr})
		keys, err := rc.DBSize(ctx).Result()
		rc.Close()
		if err != nil || keys == 0 {
			t.Errorf("master %s holds %d of 64 tenants' keys (%v), want some", n.Addr, keys, err)
		}
	}
}
