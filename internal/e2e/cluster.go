package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartRedisCluster runs a Redis Cluster of masters private redis-servers
// (StartRedis), each with replicas replicas of its own, every node in a
// directory of its own under dir (its nodes.conf survives a Kill, so a
// node restarted with Up rejoins), joins them with redis-cli --cluster
// create and returns once every node reports cluster_state:ok and every
// replica is in sync. The masters come first in the result; a node's
// timeout is 2 s, so a killed master's replica takes over within a few
// seconds. On an error it stops what it started.
func StartRedisCluster(ctx context.Context, dir string, masters, replicas int) ([]*Server, error) {
	var nodes []*Server
	fail := func(err error) ([]*Server, error) {
		for _, n := range nodes {
			n.Close()
		}
		return nil, err
	}
	args := []string{"--cluster", "create"}
	for range masters * (1 + replicas) {
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
	// redis-cli makes the first masters nodes the masters.
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("redis-cli --cluster create: %v\n%s", err, out))
	}
	for _, n := range nodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		err := WaitClusterOK(ctx, c)
		if err == nil {
			err = waitReplicaSynced(ctx, c)
		}
		c.Close()
		if err != nil {
			return fail(fmt.Errorf("cluster node %s: %w", n.Addr, err))
		}
	}
	return nodes, nil
}

// WaitClusterOK waits until the cluster node c reports cluster_state:ok:
// every slot served, e.g. once a killed master's replica has taken over.
func WaitClusterOK(ctx context.Context, c *redis.Client) error {
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

// waitReplicaSynced waits, on a replica, until its master link is up and
// the first sync is done; a master passes at once.
func waitReplicaSynced(ctx context.Context, c *redis.Client) error {
	for {
		info, err := c.Info(ctx, "replication").Result()
		if err == nil && (strings.Contains(info, "role:master") ||
			strings.Contains(info, "master_link_status:up") && strings.Contains(info, "master_sync_in_progress:0")) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("replica not in sync (last: %v): %w", err, ctx.Err())
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

// StartNATSCluster runs a JetStream cluster of n private nats-servers
// (nats-1 … nats-n, routed to each other, storing under dir) and returns
// once every node knows the cluster's JetStream meta leader, so that a
// replicated stream can be created. A node restarted with Up keeps its
// store and rejoins.
func StartNATSCluster(ctx context.Context, dir string, n int) ([]*Server, error) {
	ports, err := FreePorts(3 * n) // per node: clients, monitoring, routes
	if err != nil {
		return nil, err
	}
	route := func(i int) string { return "nats://127.0.0.1:" + strconv.Itoa(ports[3*i+2]) }
	var nodes []*Server
	for i := range n {
		var routes []string
		for j := range n {
			if j != i {
				routes = append(routes, route(j))
			}
		}
		name := "nats-" + strconv.Itoa(i+1)
		s, err := startNATS(ctx, dir, name, ports[3*i], ports[3*i+1], "-server_name", name,
			"-cluster_name", "quotaflow", "-cluster", route(i), "-routes", strings.Join(routes, ","))
		if err != nil {
			for _, s := range nodes {
				s.Close()
			}
			return nil, err
		}
		nodes = append(nodes, s)
	}
	for _, s := range nodes {
		if err := WaitJetStreamLeader(ctx, s); err != nil {
			for _, s := range nodes {
				s.Close()
			}
			return nil, err
		}
	}
	return nodes, nil
}

// WaitJetStreamLeader waits until the cluster node s names a JetStream
// meta leader (its /jsz).
func WaitJetStreamLeader(ctx context.Context, s *Server) error {
	c := &http.Client{Timeout: 2 * time.Second}
	for {
		var jsz struct {
			Meta struct {
				Leader string `json:"leader"`
			} `json:"meta_cluster"`
		}
		resp, err := c.Get(s.Monitor + "/jsz")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&jsz)
			resp.Body.Close()
		}
		if err == nil && jsz.Meta.Leader != "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s names no JetStream leader (last: %v): %w", s.Name, err, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// NATSClusterURL is the QF_NATS_URL of a cluster's nodes: every node's
// URL, comma-separated, as nats.Connect takes them.
func NATSClusterURL(nodes []*Server) string {
	urls := make([]string, len(nodes))
	for i, n := range nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}
