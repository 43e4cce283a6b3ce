package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartRedisCluster runs a Redis Cluster of masters private redis-servers
// (StartRedis, no replicas), each in a directory of its own under dir, joins
// them with redis-cli --cluster create and returns once every node reports
// cluster_state:ok. On an error it stops what it started.
func StartRedisCluster(ctx context.Context, dir string, masters int) ([]*Server, error) {
	var nodes []*Server
	fail := func(err error) ([]*Server, error) {
		for _, n := range nodes {
			n.Close()
		}
		return nil, err
	}
	args := []string{"--cluster", "create"}
	for range masters {
		d, err := os.MkdirTemp(dir, "redis-node")
		if err != nil {
			return fail(err)
		}
		n, err := StartRedis(ctx, d, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000")
		if err != nil {
			return fail(err)
		}
		nodes = append(nodes, n)
		args = append(args, n.Addr)
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("redis-cli --cluster create: %v\n%s", err, out))
	}
	for _, n := range nodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		err := waitClusterOK(ctx, c)
		c.Close()
		if err != nil {
			return fail(fmt.Errorf("cluster node %s: %w", n.Addr, err))
		}
	}
	return nodes, nil
}

func waitClusterOK(ctx context.Context, c *redis.Client) error {
	for {
		info, err := c.ClusterInfo(ctx).Result()
		if err == nil && strings.Contains(info, "cluster_state:ok") {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no cluster_state:ok (last: %v): %w", err, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ClusterURL is the QF_REDIS_URL of a cluster's nodes: the first as the
// URL's host, the others as addr= seeds (internal/redisconn).
func ClusterURL(nodes []*Server) string {
	u := "redis://" + nodes[0].Addr + "/0"
	for i, n := range nodes[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		u += sep + "addr=" + n.Addr
	}
	return u
}
