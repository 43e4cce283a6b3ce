package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	nodes, err := StartRedisCluster(ctx, t.TempDir(), 3, 0)
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

// TestRedisClusterFailover starts three masters with a replica each, kills
// the master of a key and checks that its replica takes over with the
// key, and that the old master comes back as a replica.
func TestRedisClusterFailover(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nodes, err := StartRedisCluster(ctx, t.TempDir(), 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		t.Cleanup(n.Close)
	}
	if len(nodes) != 6 {
		t.Fatalf("%d nodes, want 6", len(nodes))
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].Addr}})
	defer cc.Close()
	roles := map[string]int{}
	for _, n := range nodes {
		rc := redis.NewClient(&redis.Options{Addr: n.Addr})
		r, err := rc.Do(ctx, "ROLE").Slice()
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		roles[fmt.Sprint(r[0])]++
	}
	if roles["master"] != 3 || roles["slave"] != 3 {
		t.Fatalf("roles %v, want 3 masters and 3 replicas", roles)
	}
	master, err := cc.MasterForKey(ctx, "{t}:k")
	if err != nil {
		t.Fatal(err)
	}
	// The replica has it once WAIT says so. WAIT counts the writes of its
	// own connection, so both go to the key's master in one pipeline (the
	// cluster client would send a keyless WAIT to any node).
	pipe := master.Pipeline()
	pipe.Set(ctx, "{t}:k", "v", 0)
	acked := pipe.Do(ctx, "WAIT", 1, 5000)
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := acked.Int(); n < 1 || err != nil {
		t.Fatalf("WAIT = %d, %v; want the replica's ack", n, err)
	}
	var killed *Server
	var other *redis.Client
	for _, n := range nodes {
		if n.Addr == master.Options().Addr {
			killed = n
		} else if other == nil {
			other = redis.NewClient(&redis.Options{Addr: n.Addr})
		}
	}
	defer other.Close()
	killed.Kill()
	// The cluster first marks the master failed, then elects a replica.
	slot, err := other.ClusterKeySlot(ctx, "{t}:k").Result()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if addr := slotMaster(ctx, other, slot); addr != "" && addr != killed.Addr {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("no replica took over the slot of {t}")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := WaitClusterOK(ctx, other); err != nil {
		t.Fatal(err)
	}
	// A client that starts now (one that ran before the failover learns
	// the new map once it reloads it).
	after := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{other.Options().Addr}})
	defer after.Close()
	if v, err := after.Get(ctx, "{t}:k").Result(); v != "v" || err != nil {
		t.Errorf("after the failover GET {t}:k = %q, %v; want the replicated value", v, err)
	}
	if err := killed.Up(ctx); err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: killed.Addr})
	defer rc.Close()
	for {
		r, err := rc.Do(ctx, "ROLE").Slice()
		if err == nil && fmt.Sprint(r[0]) == "slave" {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the old master did not rejoin as a replica: ROLE %v, %v", r, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// slotMaster is the address of the master serving slot, as node c sees
// it; "" if none.
func slotMaster(ctx context.Context, c *redis.Client, slot int64) string {
	slots, err := c.ClusterSlots(ctx).Result()
	if err != nil {
		return ""
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr
		}
	}
	return ""
}

// TestNATSCluster starts a three-node JetStream cluster from its
// comma-separated URL, stores in an R3 stream, and keeps storing while
// the node it is connected to is down.
func TestNATSCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nodes, err := StartNATSCluster(ctx, t.TempDir(), 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		t.Cleanup(n.Close)
	}
	nc, err := nats.Connect(NATSClusterURL(nodes), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}, Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "t.a", []byte("1")); err != nil {
		t.Fatal(err)
	}
	var down *Server
	for _, n := range nodes {
		if n.URL == nc.ConnectedUrl() {
			down = n
		}
	}
	if down == nil {
		t.Fatalf("connected to %s, not a node of %s", nc.ConnectedUrl(), NATSClusterURL(nodes))
	}
	down.Kill()
	for {
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := js.Publish(pctx, "t.a", []byte("2"))
		pcancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("no publish with %s down: %v", down.Name, err)
		}
	}
	if err := down.Up(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 2 || info.Config.Replicas != 3 {
		t.Errorf("stream holds %d messages in %d replicas, want 2 in 3", info.State.Msgs, info.Config.Replicas)
	}
}
