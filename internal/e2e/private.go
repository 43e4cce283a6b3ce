package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/pgdb"
	"quotaflow/pkg/events/stream"
)

// PrivateConfig is what StartPrivate runs: the three services of this
// checkout with a policy, on servers of their own.
type PrivateConfig struct {
	Name     string // names the run's temporary directory (quotaflow-<Name>-)
	Root     string // the checkout the services are built from; "" for this module's
	Policy   string // the policy YAML
	Webhooks string // the alerter's webhooks YAML; "" for none (alerts counted, not sent)
	Token    string // admission's API token; "" for no authentication
	// Env is added to every service's settings, after the stack's own
	// (servers, policy), so it can override them; AdmissionEnv,
	// AccounterEnv and AlerterEnv to one service's, after Env.
	Env                                    []string
	AdmissionEnv, AccounterEnv, AlerterEnv []string
	Out                                    io.Writer // progress lines; nil for none
	// PostgresArgs are further settings of the Postgres server
	// (StartPostgres).
	PostgresArgs []string
	// NATSArgs are more arguments of the one nats-server (not of a
	// Cluster's nodes), e.g. "-profile", a port.
	NATSArgs []string
	// Cluster runs the clustered shape (docs/design.md §9) instead of one
	// server and one instance of each: a Redis Cluster of 3 masters with a
	// replica each, a 3-node JetStream cluster with R3 streams, two
	// admission instances (QF_INSTANCES=2) and two accounters on one
	// durable consumer.
	Cluster bool
}

// Private is the whole pipeline on private servers: redis-server,
// nats-server (JetStream on disk) and a Postgres cluster, each on a free
// loopback port, so that a run can crash them (the chaos suite) and that
// every process's CPU is the run's alone (the pipeline benchmark); and
// admission, the accounter and the alerter built from this checkout.
type Private struct {
	Dir string // the run's files: logs, binaries, policy, data
	// Redis and NATS are the only server of each kind, nil in a Cluster
	// run, whose nodes are in RedisNodes (masters first) and NATSNodes.
	Redis, NATS, Postgres *Server
	RedisNodes, NATSNodes []*Server
	RedisURL, NATSURL     string // what the services are configured with
	// Admission and Accounter are the first of Admissions and Accounters.
	Admission, Accounter, Alerter *Service
	Admissions, Accounters        []*Service
	API                           string   // the first admission's base URL
	APIs                          []string // every admission instance's, in the order of Admissions
	DBURL                         string   // the ledger's database
}

// Services returns every service, the admission instances last.
func (p *Private) Services() []*Service {
	return append(append(slices.Clone(p.Accounters), p.Alerter), p.Admissions...)
}

// Pipeline is the stack's pipeline with the services' default stream,
// dead-letter stream and accounter durable (StartPrivate sets none).
func (p *Private) Pipeline() Pipeline {
	d := stream.Defaults()
	ops := make([]string, len(p.Admissions))
	for i, a := range p.Admissions {
		ops[i] = a.Ops
	}
	return Pipeline{AdmissionOps: ops, NATSURL: p.NATSURL, Stream: d.Stream, Durable: "accounter", DLQ: d.DLQStream, DBURL: p.DBURL}
}

// StartPrivate builds the services, starts the servers and the services
// and waits until every service is ready and admission decides from
// Redis. On an error it returns what it started, for the caller to Close.
func StartPrivate(ctx context.Context, cfg PrivateConfig) (*Private, error) {
	out := cfg.Out
	if out == nil {
		out = io.Discard
	}
	dir, err := os.MkdirTemp("", "quotaflow-"+cfg.Name+"-")
	if err != nil {
		return nil, err
	}
	p := &Private{Dir: dir}
	root := cfg.Root
	if root == "" {
		if root, err = ModuleRoot(ctx); err != nil {
			return p, err
		}
	}
	fmt.Fprintln(out, "building the services ...")
	binDir := filepath.Join(dir, "bin")
	if err := Build(ctx, root, binDir); err != nil {
		return p, err
	}
	fmt.Fprintln(out, "starting private redis-server, nats-server and postgres ...")
	instances := 1
	common := []string{}
	if cfg.Cluster {
		instances = 2
		if p.RedisNodes, err = StartRedisCluster(ctx, dir, 3, 1); err != nil {
			return p, err
		}
		if p.NATSNodes, err = StartNATSCluster(ctx, dir, 3); err != nil {
			return p, err
		}
		p.RedisURL, p.NATSURL = ClusterURL(p.RedisNodes), NATSClusterURL(p.NATSNodes)
		common = append(common, "QF_STREAM_REPLICAS=3")
		// Created once before the services start: nats-server 2.9 leaves
		// some of several concurrent creates of one R3 stream unanswered
		// (a service's start-up step then waits out its 30 s attempt).
		if err := ensureStreams(ctx, p.NATSURL, 3); err != nil {
			return p, err
		}
	} else {
		if p.Redis, err = StartRedis(ctx, dir); err != nil {
			return p, err
		}
		if p.NATS, err = StartNATS(ctx, dir, cfg.NATSArgs...); err != nil {
			return p, err
		}
		p.RedisNodes, p.NATSNodes = []*Server{p.Redis}, []*Server{p.NATS}
		p.RedisURL, p.NATSURL = p.Redis.URL, p.NATS.URL
	}
	if p.Postgres, err = StartPostgres(ctx, dir, cfg.PostgresArgs...); err != nil {
		return p, err
	}
	p.DBURL = "postgres://postgres@" + p.Postgres.Addr + "/quotaflow?sslmode=disable"
	cc, err := pgx.ParseConfig(p.DBURL)
	if err != nil {
		return p, err
	}
	if err := pgdb.CreateDatabase(ctx, cc); err != nil {
		return p, fmt.Errorf("create database: %w", err)
	}
	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte(cfg.Policy), 0o600); err != nil {
		return p, err
	}
	common = append(common,
		"QF_REDIS_URL="+p.RedisURL, "QF_NATS_URL="+p.NATSURL, "QF_POSTGRES_URL="+p.DBURL,
		"QF_POLICY_FILE="+policy)
	common = append(common, cfg.Env...)
	// Every service's ops port, each accounter's console's and each
	// admission's API's, chosen at once.
	addrs, err := FreeAddrs(1 + 4*instances)
	if err != nil {
		return p, err
	}
	// An instance of a service is named after it, its log too: accounter,
	// accounter-2, ...
	start := func(service string, i int, ops string, env ...string) (*Service, error) {
		name := service
		if i > 0 {
			name = fmt.Sprintf("%s-%d", service, i+1)
		}
		env = append(append(append([]string{}, common...), env...), "QF_OPS_ADDR="+ops)
		return Start(name, filepath.Join(binDir, service), dir, ops, env)
	}
	for i := range instances {
		ops, console := addrs[1+4*i], addrs[2+4*i]
		a, err := start("accounter", i, ops, append([]string{"QF_CONSOLE_ADDR=" + console}, cfg.AccounterEnv...)...)
		if err != nil {
			return p, err
		}
		p.Accounters = append(p.Accounters, a)
	}
	p.Accounter = p.Accounters[0]
	// Its alerts API on a port of its own: the default :8082 is one per
	// machine, and two stacks run side by side (bench/pipeline -ab).
	alerterEnv := append([]string{"QF_ALERTS_ADDR=127.0.0.1:0"}, cfg.AlerterEnv...)
	if cfg.Webhooks != "" {
		hooks := filepath.Join(dir, "webhooks.yaml")
		if err := os.WriteFile(hooks, []byte(cfg.Webhooks), 0o600); err != nil {
			return p, err
		}
		alerterEnv = append([]string{"QF_WEBHOOKS_FILE=" + hooks}, alerterEnv...)
	}
	if p.Alerter, err = start("alerter", 0, addrs[0], alerterEnv...); err != nil {
		return p, err
	}
	for i := range instances {
		ops, apiAddr := addrs[3+4*i], addrs[4+4*i]
		env := []string{"QF_ADMISSION_ADDR=" + apiAddr, "QF_SPILL_DIR=" + filepath.Join(dir, "spill", strconv.Itoa(i+1)),
			"QF_INSTANCES=" + strconv.Itoa(instances)}
		if cfg.Token != "" {
			env = append(env, "QF_API_TOKENS="+cfg.Token)
		}
		a, err := start("admission", i, ops, append(env, cfg.AdmissionEnv...)...)
		if err != nil {
			return p, err
		}
		p.Admissions, p.APIs = append(p.Admissions, a), append(p.APIs, "http://"+apiAddr)
	}
	p.Admission, p.API = p.Admissions[0], p.APIs[0]
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, s := range p.Services() {
		if err := s.WaitReady(rctx); err != nil {
			return p, err
		}
	}
	for _, a := range p.Admissions {
		if deg := a.WaitSteady(ctx, 30*time.Second); deg != "" {
			return p, fmt.Errorf("%s still degraded: %s", a.Name, deg)
		}
	}
	return p, nil
}

// Close stops the services (admission first, so nothing is left to
// publish), then the servers, and removes the run's files.
func (p *Private) Close() {
	svcs := slices.Clone(p.Admissions)
	if p.Alerter != nil {
		svcs = append(svcs, p.Alerter)
	}
	for _, svc := range append(svcs, p.Accounters...) {
		_ = svc.Stop(20 * time.Second)
	}
	if p.Postgres != nil {
		p.Postgres.Close()
	}
	for _, srv := range append(slices.Clone(p.NATSNodes), p.RedisNodes...) {
		srv.Close()
	}
	_ = os.RemoveAll(p.Dir)
}

// ensureStreams creates the services' default streams with replicas.
func ensureStreams(ctx context.Context, url string, replicas int) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cfg := stream.Defaults()
	cfg.Replicas = replicas
	return stream.Ensure(ctx, js, cfg)
}
