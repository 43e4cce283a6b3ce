package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
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

// MigrateSlot moves slot from the master from to the master to as
// redis-cli --cluster reshard does: to imports it, from migrates it, its
// keys go over batch at a time (MIGRATE ... KEYS), waiting pause between
// batches so that traffic meets the slot half moved (ASK and TRYAGAIN
// answers), and then every master of masters (from and to among them)
// learns that to serves it. It returns how many keys went over.
func MigrateSlot(ctx context.Context, slot int, from, to *redis.Client, masters []*redis.Client, batch int, pause time.Duration) (int, error) {
	fromID, err := from.ClusterMyID(ctx).Result()
	if err != nil {
		return 0, err
	}
	toID, err := to.ClusterMyID(ctx).Result()
	if err != nil {
		return 0, err
	}
	if err := to.Do(ctx, "cluster", "setslot", slot, "importing", fromID).Err(); err != nil {
		return 0, fmt.Errorf("setslot importing: %w", err)
	}
	if err := from.Do(ctx, "cluster", "setslot", slot, "migrating", toID).Err(); err != nil {
		return 0, fmt.Errorf("setslot migrating: %w", err)
	}
	host, port, ok := strings.Cut(to.Options().Addr, ":")
	if !ok {
		return 0, fmt.Errorf("migrate: target address %q has no port", to.Options().Addr)
	}
	moved := 0
	for {
		keys, err := from.ClusterGetKeysInSlot(ctx, slot, batch).Result()
		if err != nil {
			return moved, fmt.Errorf("getkeysinslot: %w", err)
		}
		if len(keys) == 0 {
			break
		}
		args := []any{"migrate", host, port, "", 0, 5000, "keys"}
		for _, k := range keys {
			args = append(args, k)
		}
		// NOKEY: the keys expired or were deleted meanwhile.
		if err := from.Do(ctx, args...).Err(); err != nil && !strings.HasPrefix(err.Error(), "NOKEY") {
			return moved, fmt.Errorf("migrate: %w", err)
		}
		moved += len(keys)
		select {
		case <-ctx.Done():
			return moved, ctx.Err()
		case <-time.After(pause):
		}
	}
	// The new owner first, then the old one, then the others, as redis-cli
	// does: the old owner then answers MOVED to the new one.
	order := []*redis.Client{to, from}
	for _, m := range masters {
		if m != to && m != from {
			order = append(order, m)
		}
	}
	for _, m := range order {
		if err := m.Do(ctx, "cluster", "setslot", slot, "node", toID).Err(); err != nil {
			return moved, fmt.Errorf("setslot node on %s: %w", m.Options().Addr, err)
		}
	}
	return moved, nil
}

// ErrorStats sums, over nodes, the errors each has answered whose code is
// among codes (INFO errorstats, e.g. "ASK", "MOVED", "TRYAGAIN").
func ErrorStats(ctx context.Context, nodes []*redis.Client, codes ...string) (map[string]int64, error) {
	out := map[string]int64{}
	for _, n := range nodes {
		info, err := n.Info(ctx, "errorstats").Result()
		if err != nil {
			return nil, err
		}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":count=")
			code := strings.TrimPrefix(name, "errorstat_")
			if !ok || !slices.Contains(codes, code) {
				continue
			}
			v, err := strconv.ParseInt(rest, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("errorstats %q: %w", line, err)
			}
			out[code] += v
		}
	}
	return out, nil
}
