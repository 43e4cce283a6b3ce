package e2e

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

// TestServersRestart starts the private servers, crashes each and brings
// it back: Redis empty, NATS with its streams, Postgres with its data.
func TestServersRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts redis-server, nats-server and postgres")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()

	rs, err := StartRedis(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	opt, _ := redis.ParseURL(rs.URL)
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	rs.Kill()
	if err := rs.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := rdb.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("redis after restart: exists(k) = %d, %v; want 0 (empty)", n, err)
	}

	ns, err := StartNATS(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	nc, err := nats.Connect(ns.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := nc.JetStream()
	if _, err := js.AddStream(&nats.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: nats.FileStorage}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish("s.x", []byte("1")); err != nil {
		t.Fatal(err)
	}
	ns.Kill()
	if err := ns.Up(ctx); err != nil {
		t.Fatal(err)
	}
	var msgs uint64
	for try := 0; try < 100; try++ {
		if si, err := js.StreamInfo("S"); err == nil {
			msgs = si.State.Msgs
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if msgs != 1 {
		t.Errorf("stream after a NATS restart holds %d messages, want 1", msgs)
	}

	ps, err := StartPostgres(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	exec := func(sql string) error {
		c, err := pgx.Connect(ctx, ps.URL)
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		_, err = c.Exec(ctx, sql)
		return err
	}
	if err := exec("CREATE TABLE t (x int); INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if err := ps.Signal(syscall.SIGQUIT, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := ps.Up(ctx); err != nil {
		t.Fatal(err)
	}
	var err2 error
	for try := 0; try < 100; try++ { // recovery: refused while starting up
		if err2 = exec("SELECT 1 FROM t WHERE x = 1"); err2 == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err2 != nil {
		t.Errorf("postgres after an immediate shutdown: %v", err2)
	}
}
