package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/plans"
	"quotaflow/bench/internal/proc"
	"quotaflow/internal/e2e"
	"quotaflow/internal/envoypeer"
)

// Config is one benchmark run.
type Config struct {
	Duration time.Duration // load per round
	Warmup   time.Duration // unmeasured pipeline load before the rounds
	Conns    int           // connections of the closed loop
	Users    int           // distinct users, drawn at random per request
	Rounds   int           // measured rounds of each target, interleaved
	Settle   time.Duration // bound on the wait for the ledger after a round
	Base     string        // a checkout of an earlier commit: its services run too, as "before"
	Envoy    bool          // measure envoyproxy/ratelimit in the same rounds
	EnvoyBin string        // its service_cmd binary; "" builds the pinned one
	Env      []string      // extra environment of this checkout's services only (with Base: a setting measured both ways)
	// NATSProfile, when set, is a directory for a CPU profile of this
	// checkout's nats-server over each measured round's load.
	NATSProfile string
	// RedisCalls splits each round's Redis calls by FCALL function
	// through the slowlog, which then logs every call.
	RedisCalls bool
}

// meter reads a process's CPU time so far.
type meter struct {
	name string
	cpu  func() (time.Duration, error)
	// part marks a share of another meter's process (Postgres's backends
	// of one service): shown, not added to the total.
	part bool
}

func pidMeter(name string, pid int) meter {
	return meter{name: name, cpu: func() (time.Duration, error) { return proc.CPU(pid) }}
}

// read returns every meter's CPU time, in the meters' order.
func read(ms []meter) ([]time.Duration, error) {
	out := make([]time.Duration, len(ms))
	for i, m := range ms {
		d, err := m.cpu()
		if err != nil {
			return nil, fmt.Errorf("cpu of %s: %w", m.name, err)
		}
		out[i] = d
	}
	return out, nil
}

// round is what one measured round of the pipeline did.
type round struct {
	elapsed   time.Duration // the load, from its start to its last answer
	t         *tally        // the round's requests
	accounted int64         // actual events the ledger gained during the load
	catchUp   time.Duration // from the end of the load until the ledger held every report
	// alerterCatchUp is from the end of the load until the alerter had
	// consumed every event.
	alerterCatchUp time.Duration
	// cpu is per meter, from the start of the load until the ledger held
	// every report and the alerter had consumed every event: all the work
	// of the round's requests, even when the accounter or the alerter lags
	// behind the load.
	cpu  []time.Duration
	span time.Duration // cpu's
	wal  wal           // Postgres's WAL over the same span
	// batches and batchEvents are the accounter's batches over the same
	// span and the events in them.
	batches, batchEvents float64
	// handled is admission's own time on the calls over the same span.
	handled handled
	// nats is what nats-server counted over the same span.
	nats natsCounts
	// redis is INFO commandstats over the same span; slow the slowlog's
	// calls by function (Config.RedisCalls).
	redis, slow redisCalls
}

func (r round) admittedRate() float64  { return float64(r.t.admitted) / r.elapsed.Seconds() }
func (r round) accountedRate() float64 { return float64(r.accounted) / r.elapsed.Seconds() }
func (r round) keepUp() float64        { return float64(r.accounted) / max(1, float64(r.t.admitted)) }

// perAccounted is meter i's CPU per request accounted: per report, since
// cpu runs until the ledger held them all.
func (r round) perAccounted(i int) time.Duration {
	return r.cpu[i] / time.Duration(max(1, r.t.reported))
}

// all is the CPU of every process of ms, not their parts, over the
// round's span.
func (r round) all(ms []meter) time.Duration {
	var sum time.Duration
	for i, m := range ms {
		if !m.part {
			sum += r.cpu[i]
		}
	}
	return sum
}

// cores is all over the span's length: the cores the processes kept busy.
func (r round) cores(ms []meter) float64 { return float64(r.all(ms)) / float64(max(1, r.span)) }

// perReport is n per request accounted.
func (r round) perReport(n int64) float64 { return float64(n) / float64(max(1, r.t.reported)) }

// pipeline is the started pipeline and what the rounds so far did.
type pipeline struct {
	cfg    Config
	name   string  // "this checkout", or "before" and "after"
	done   []round // the measured rounds
	p      *e2e.Private
	host   string // admission's host:port
	ledger *ledger
	redis  *redis.Client // its redis-server, for commandstats
	meters []meter
	pprof  string // nats-server's pprof endpoint (Config.NATSProfile), or ""
	total  *tally // every round's, the warm-up's included
	rounds int    // rounds begun, the warm-up's included: seeds the users
}

func run(ctx context.Context, cfg Config, out io.Writer) error {
	srcs := []struct{ name, root string }{{"this checkout", ""}}
	if cfg.Base != "" {
		srcs = []struct{ name, root string }{{"before", cfg.Base}, {"after", ""}}
	}
	var pls []*pipeline
	for _, src := range srcs {
		fmt.Fprintf(out, "%s: ", src.name)
		pl, err := startPipeline(ctx, cfg, src.name, src.root, out)
		if pl != nil {
			defer pl.close()
		}
		if err != nil {
			return err
		}
		pls = append(pls, pl)
	}

	var rl *peer
	var peerMeters []meter
	if cfg.Envoy {
		fmt.Fprintln(out, "starting envoyproxy/ratelimit "+envoypeer.Version+" ...")
		bin := cfg.EnvoyBin
		if bin == "" {
			var err error
			if bin, err = envoypeer.Binary(); err != nil {
				return err
			}
		}
		var err error
		rl, err = startEnvoy(ctx, pls[0].p.Dir, bin)
		if rl != nil {
			defer rl.close()
		}
		if err != nil {
			return err
		}
		peerMeters = []meter{
			pidMeter("ratelimit", rl.svc.Cmd.Process.Pid),
			pidMeter("redis-server", rl.redis.Cmd.Process.Pid),
			pidMeter("load generator", os.Getpid()),
		}
	}

	// One step per target and round; each round starts one target later,
	// so that a machine getting busier or quieter weighs on all alike.
	var steps []func(round int, d time.Duration) error
	for _, pl := range pls {
		steps = append(steps, func(i int, d time.Duration) error {
			fmt.Fprintf(out, "round %d: %v of pipeline load (%s) ...\n", i, d, pl.name)
			r, err := pl.round(ctx, fmt.Sprintf("r%d", i), d)
			if i > 0 {
				pl.done = append(pl.done, r)
			}
			return err
		})
	}
	var checks []peerRound
	if rl != nil {
		steps = append(steps, func(i int, d time.Duration) error {
			fmt.Fprintf(out, "round %d: %v of ratelimit load ...\n", i, d)
			c, err := rl.round(ctx, peerMeters, cfg.Conns, cfg.Users, d)
			if i > 0 {
				checks = append(checks, c)
			}
			return err
		})
	}
	for _, step := range steps { // round 0: the warm-up
		if err := step(0, cfg.Warmup); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
	}
	for i := 1; i <= cfg.Rounds; i++ {
		for j := range steps {
			if err := steps[(i+j)%len(steps)](i, cfg.Duration); err != nil {
				return fmt.Errorf("round %d: %w", i, err)
			}
		}
	}
	var failed []string
	for _, pl := range pls {
		bad := check(ctx, pl.ledger, pl.p.NATS.URL, "QUOTAFLOW_DLQ", pl.total, cfg.Settle)
		failopen := failopens(ctx, pl.p.Admission)
		report(out, cfg, pl, failopen, bad)
		diskReport(ctx, out, pl.ledger)
		statementReport(ctx, out, pl.ledger, pl.total.reported)
		if len(bad) > 0 {
			failed = append(failed, pl.name+": the end state is not exact")
		}
		if failopen != 0 {
			failed = append(failed, fmt.Sprintf("%s: %.0f admits were decided without Redis: the figures are not the pipeline's", pl.name, failopen))
		}
	}
	if rl != nil {
		reportPeer(out, peerMeters, checks, pls)
	}
	if len(failed) > 0 {
		return errors.New(strings.Join(failed, "; "))
	}
	return nil
}

// startPipeline starts the pipeline with the services built from the
// checkout root ("" for this one) and what the rounds need of it.
func startPipeline(ctx context.Context, cfg Config, name, root string, out io.Writer) (*pipeline, error) {
	env := []string{"QF_LOG_LEVEL=warn"}
	var natsArgs []string
	pprof := ""
	if root == "" {
		env = append(env, cfg.Env...)
		if cfg.NATSProfile != "" {
			port, err := e2e.FreePort()
			if err != nil {
				return nil, err
			}
			natsArgs = []string{"-profile", strconv.Itoa(port)}
			pprof = "http://127.0.0.1:" + strconv.Itoa(port) + "/debug/pprof/profile"
		}
	}
	p, err := e2e.StartPrivate(ctx, e2e.PrivateConfig{
		Name: "pipeline", Root: root, Policy: plans.Five, Out: out,
		Env: env, NATSArgs: natsArgs,
		// Named, so that Postgres's CPU splits by the service a backend serves.
		AccounterEnv: []string{"PGAPPNAME=" + accounterApp},
		// Consuming, with no webhook: a quota never reaches a threshold.
		AlerterEnv: []string{"QF_CONSUMER=" + alerterConsumer, "PGAPPNAME=" + alerterApp},
		// A busy two-core machine answers in more than the default 10 ms
		// at times; a decision made without Redis then is cheaper and not
		// the pipeline's, so the run waits for Redis instead (and counts
		// the failopens it still sees).
		AdmissionEnv: []string{"QF_REDIS_TIMEOUT=1s"},
		// What each statement costs (statementReport).
		PostgresArgs: []string{"-c", "shared_preload_libraries=pg_stat_statements"},
	})
	pl := &pipeline{cfg: cfg, name: name, p: p, total: newTally(), pprof: pprof}
	if err != nil {
		return pl, err
	}
	u, err := url.Parse(p.API)
	if err != nil {
		return pl, err
	}
	pl.host = u.Host
	if pl.ledger, err = openLedger(ctx, p.DBURL); err != nil {
		return pl, err
	}
	pl.redis = redis.NewClient(&redis.Options{Addr: p.Redis.Addr})
	if cfg.RedisCalls {
		if err := logEveryCall(ctx, pl.redis); err != nil {
			return pl, err
		}
	}
	pl.meters = []meter{
		pidMeter("admission", p.Admission.Cmd.Process.Pid),
		pidMeter("accounter", p.Accounter.Cmd.Process.Pid),
		pidMeter("alerter", p.Alerter.Cmd.Process.Pid),
		pidMeter("redis-server", p.Redis.Cmd.Process.Pid),
		pidMeter("nats-server", p.NATS.Cmd.Process.Pid),
		// The postmaster and its backends, those that exit included.
		{name: "postgres", cpu: func() (time.Duration, error) { return proc.TreeCPU(p.Postgres.Cmd.Process.Pid) }},
		{name: "postgres: accounter's", cpu: func() (time.Duration, error) { return pl.ledger.backendsCPU(ctx, accounterApp) }, part: true},
		{name: "postgres: alerter's", cpu: func() (time.Duration, error) { return pl.ledger.backendsCPU(ctx, alerterApp) }, part: true},
		pidMeter("load generator", os.Getpid()),
	}
	return pl, nil
}

func (pl *pipeline) close() {
	if pl.ledger != nil {
		pl.ledger.close()
	}
	if pl.redis != nil {
		pl.redis.Close()
	}
	if pl.p != nil {
		pl.p.Close()
	}
}

// failopens is how many decisions admission made without Redis (after
// its deadline, QF_REDIS_TIMEOUT): cheaper ones, which a figure should
// not be made of.
func failopens(ctx context.Context, admission *e2e.Service) float64 {
	ds, err := e2e.Decisions(ctx, admission.Ops)
	if err != nil {
		return -1
	}
	var n float64
	for _, d := range ds {
		if d.Result == "failopen" {
			n += d.Count
		}
	}
	return n
}

// round plays the pipeline load for d, waits for the ledger to hold every
// report and returns what it measured. name prefixes the request ids.
func (pl *pipeline) round(ctx context.Context, name string, d time.Duration) (round, error) {
	n0, _, err := pl.ledger.actuals(ctx)
	if err != nil {
		return round{}, err
	}
	tallies := make([]*tally, pl.cfg.Conns)
	seed := uint64(pl.rounds * pl.cfg.Conns)
	pl.rounds++
	cpu0, err := read(pl.meters)
	if err != nil {
		return round{}, err
	}
	start := time.Now()
	wal0, err := pl.ledger.wal(ctx)
	if err != nil {
		return round{}, err
	}
	b0, e0 := batches(ctx, pl.p.Accounter.Ops)
	h0 := handlerTimes(ctx, pl.p.Admission.Ops)
	nats0, err := readNATS(ctx, pl.p.NATS.Monitor)
	if err != nil {
		return round{}, err
	}
	redis0, err := commandStats(ctx, pl.redis)
	if err != nil {
		return round{}, err
	}
	if pl.cfg.RedisCalls {
		if _, err := slowCalls(ctx, pl.redis); err != nil {
			return round{}, err
		}
	}
	profiled := make(chan error, 1)
	if pl.pprof != "" && name != "r0" {
		go func() {
			profiled <- saveProfile(ctx, pl.pprof, d, filepath.Join(pl.cfg.NATSProfile, "nats-"+name+".pprof"))
		}()
	} else {
		profiled <- nil
	}
	res, err := load.Run(ctx, load.Config{
		Addr: pl.host, Conns: pl.cfg.Conns, Duration: d,
		NewClient: func(conn int) load.Client {
			tallies[conn] = newTally()
			prefix := fmt.Sprintf("%s-c%d-", name, conn)
			return newClient(pl.host, prefix, pl.cfg.Users, seed+uint64(conn), tallies[conn])
		},
	})
	if err != nil {
		return round{}, err
	}
	end := time.Now()
	if err := <-profiled; err != nil {
		return round{}, err
	}
	n1, _, err := pl.ledger.actuals(ctx)
	if err != nil {
		return round{}, err
	}
	r := round{elapsed: res.Elapsed, t: newTally(), accounted: n1 - n0}
	for _, t := range tallies {
		r.t.add(t)
	}
	pl.total.add(r.t)
	if r.catchUp, err = pl.ledger.waitActuals(ctx, pl.p.Accounter.Ops, pl.total.reported, end, pl.cfg.Settle); err != nil {
		return r, err
	}
	if r.alerterCatchUp, err = waitAlerter(ctx, pl.p.NATS.URL, end, pl.cfg.Settle); err != nil {
		return r, err
	}
	cpu1, err := read(pl.meters)
	if err != nil {
		return round{}, err
	}
	r.span = time.Since(start)
	nats1, err := readNATS(ctx, pl.p.NATS.Monitor)
	if err != nil {
		return round{}, err
	}
	r.nats = nats1.sub(nats0)
	redis1, err := commandStats(ctx, pl.redis)
	if err != nil {
		return round{}, err
	}
	r.redis = redis1.sub(redis0)
	if pl.cfg.RedisCalls {
		if r.slow, err = slowCalls(ctx, pl.redis); err != nil {
			return round{}, err
		}
	}
	for i := range cpu1 {
		r.cpu = append(r.cpu, cpu1[i]-cpu0[i])
	}
	wal1, err := pl.ledger.wal(ctx)
	if err != nil {
		return round{}, err
	}
	r.wal = wal{wal1.records - wal0.records, wal1.bytes - wal0.bytes}
	b1, e1 := batches(ctx, pl.p.Accounter.Ops)
	r.handled = handlerTimes(ctx, pl.p.Admission.Ops).sub(h0)
	r.batches, r.batchEvents = b1-b0, e1-e0
	return r, nil
}
