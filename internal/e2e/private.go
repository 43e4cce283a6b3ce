package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"

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
}

// Private is the whole pipeline on private servers: redis-server,
// nats-server (JetStream on disk) and a Postgres cluster, each on a free
// loopback port, so that a run can crash them (the chaos suite) and that
// every process's CPU is the run's alone (the pipeline benchmark); and
// admission, the accounter and the alerter built from this checkout.
type Private struct {
	Dir                           string // the run's files: logs, binaries, policy, data
	Redis, NATS, Postgres         *Server
	Admission, Accounter, Alerter *Service
	API                           string // admission's base URL
	DBURL                         string // the ledger's database
}

// Services returns the three services, admission last.
func (p *Private) Services() []*Service {
	return []*Service{p.Accounter, p.Alerter, p.Admission}
}

// Pipeline is the stack's pipeline with the services' default stream,
// dead-letter stream and accounter durable (StartPrivate sets none).
func (p *Private) Pipeline() Pipeline {
	d := stream.Defaults()
	return Pipeline{AdmissionOps: p.Admission.Ops, NATSURL: p.NATS.URL, Stream: d.Stream, Durable: "accounter", DLQ: d.DLQStream, DBURL: p.DBURL}
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
	if p.Redis, err = StartRedis(ctx, dir); err != nil {
		return p, err
	}
	if p.NATS, err = StartNATS(ctx, dir); err != nil {
		return p, err
	}
	if p.Postgres, err = StartPostgres(ctx, dir); err != nil {
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
	common := []string{
		"QF_REDIS_URL=" + p.Redis.URL, "QF_NATS_URL=" + p.NATS.URL, "QF_POSTGRES_URL=" + p.DBURL,
		"QF_POLICY_FILE=" + policy,
	}
	common = append(common, cfg.Env...)
	// Every service's ops port, the console's and the API's, chosen at once.
	addrs, err := FreeAddrs(5)
	if err != nil {
		return p, err
	}
	console, apiAddr := addrs[3], addrs[4]
	start := func(name, ops string, env ...string) (*Service, error) {
		env = append(append(append([]string{}, common...), env...), "QF_OPS_ADDR="+ops)
		return Start(name, filepath.Join(binDir, name), dir, ops, env)
	}
	if p.Accounter, err = start("accounter", addrs[0], append([]string{"QF_CONSOLE_ADDR=" + console}, cfg.AccounterEnv...)...); err != nil {
		return p, err
	}
	// The alerter's alerts API on a free port of its own: the default
	// (:8082) would clash between stacks.
	alerterEnv := append([]string{"QF_ALERTS_ADDR=127.0.0.1:0"}, cfg.AlerterEnv...)
	if cfg.Webhooks != "" {
		hooks := filepath.Join(dir, "webhooks.yaml")
		if err := os.WriteFile(hooks, []byte(cfg.Webhooks), 0o600); err != nil {
			return p, err
		}
		alerterEnv = append([]string{"QF_WEBHOOKS_FILE=" + hooks}, alerterEnv...)
	}
	if p.Alerter, err = start("alerter", addrs[1], alerterEnv...); err != nil {
		return p, err
	}
	p.API = "http://" + apiAddr
	admissionEnv := []string{"QF_ADMISSION_ADDR=" + apiAddr, "QF_SPILL_DIR=" + filepath.Join(dir, "spill")}
	if cfg.Token != "" {
		admissionEnv = append(admissionEnv, "QF_API_TOKENS="+cfg.Token)
	}
	if p.Admission, err = start("admission", addrs[2], append(admissionEnv, cfg.AdmissionEnv...)...); err != nil {
		return p, err
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, s := range p.Services() {
		if err := s.WaitReady(rctx); err != nil {
			return p, err
		}
	}
	if deg := p.Admission.WaitSteady(ctx, 30*time.Second); deg != "" {
		return p, fmt.Errorf("admission still degraded: %s", deg)
	}
	return p, nil
}

// Close stops the services (admission first, so nothing is left to
// publish), then the servers, and removes the run's files.
func (p *Private) Close() {
	for _, svc := range []*Service{p.Admission, p.Alerter, p.Accounter} {
		if svc != nil {
			_ = svc.Stop(20 * time.Second)
		}
	}
	for _, srv := range []*Server{p.Postgres, p.NATS, p.Redis} {
		if srv != nil {
			srv.Close()
		}
	}
	_ = os.RemoveAll(p.Dir)
}
