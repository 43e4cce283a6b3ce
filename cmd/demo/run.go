package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/llmtest"
)

// Report is what a run saw; the test asserts on it.
type Report struct {
	Run, Database   string
	API, APIToken   string // admission's API URL and a token of it
	Console         string // the web console's URL (the accounter's QF_CONSOLE_ADDR)
	ConsoleAdmin    string // the console's admin token
	ConsoleTenant   string // a console token bound to Tenants[0]
	Tenants         []string
	Stats           *e2e.Stats
	DeniedBy        map[string]int
	Decisions       []e2e.Decision
	Ledger          e2e.Ledger // the last successful read
	LedgerErr       error      // unreadable, not drained, or events lost (e2e.WaitLedger)
	LedgerMatches   bool       // the ledger's actual total is the generator's and the gateway's
	Gateway         *GatewayReport
	Alerts          map[string]int
	Thresholds      map[int]int
	ByLimit         map[string]int // threshold alerts by limit name ("<endpoint> <name>" for an endpoint's)
	BadSignatures   int
	DuplicateAlerts int
	Refires         int // threshold alerts fired again after re-arming: a window reset or usage fell back (not printed)
	// Unfounded are threshold alerts claiming more usage than the traffic
	// caused (e2e.Stats.Unfounded).
	Unfounded []e2e.ThresholdAlert
}

// run performs one demo: set up, start, play traffic, summarize, stop.
// out must take concurrent writes (os.Stdout, an e2e.Buffer): the receiver
// prints from its handler goroutines.
func run(ctx context.Context, cfg Config, out io.Writer) (*Report, error) {
	n := newNames()
	rep := &Report{Run: n.run, Database: n.database, ConsoleAdmin: n.console, ConsoleTenant: n.tenantC, Tenants: n.tenants}
	fmt.Fprintf(out, "quotaflow full demo, run %s\n", n.run)

	root, err := e2e.ModuleRoot(ctx)
	if err != nil {
		return nil, err
	}
	dir := runDir(n.run)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	fmt.Fprintln(out, "building the services ...")
	binDir := filepath.Join(dir, "bin")
	if err := e2e.Build(ctx, root, binDir); err != nil {
		return nil, err
	}

	pgURL, err := databaseURL(cfg.PostgresURL, n.database)
	if err != nil {
		return nil, err
	}
	if err := createDatabase(ctx, pgURL); err != nil {
		return nil, fmt.Errorf("postgres (run `go tool task deps`): %w", err)
	}
	recv, err := e2e.NewReceiver(n.whSecret, out)
	if err != nil {
		return nil, err
	}
	policy, hooks, err := writeFiles(dir, n, recv.URL)
	if err != nil {
		return nil, err
	}

	up := llmtest.New() // the LLM behind admission's gateway mode
	var svcs []*e2e.Service
	kept := false
	// Cleanup runs however run ends: services first (they hold the
	// database, the streams and the Redis keys), then their resources.
	defer func() {
		if kept {
			return
		}
		recv.Close()
		up.Close()
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cleanup(cctx, out, cfg, n, pgURL, dir, svcs)
	}()

	names := []string{"api", "gateway", "admission", "accounter", "alerter", "console"}
	addrs, err := e2e.FreeAddrs(len(names))
	if err != nil {
		return nil, err
	}
	addr := map[string]string{}
	for i, k := range names {
		addr[k] = addrs[i]
	}
	common := []string{
		"QF_REDIS_URL=" + cfg.RedisURL, "QF_NATS_URL=" + cfg.NATSURL, "QF_POSTGRES_URL=" + pgURL,
		"QF_POLICY_FILE=" + policy, "QF_STREAM=" + n.stream, "QF_DLQ_STREAM=" + n.dlq,
		"QF_SUBJECT_PREFIX=" + n.prefix, "QF_LOG_LEVEL=info", "QF_SHUTDOWN_TIMEOUT=5s",
	}
	specs := []struct {
		name string
		env  []string
	}{
		// The accounter first: with the epoch guard on, admission decides
		// locally until an accounter has marked the Redis.
		{"accounter", []string{"QF_OPS_ADDR=" + addr["accounter"], "QF_DURABLE=" + n.durable, "QF_CONSOLE_ADDR=" + addr["console"],
			"QF_API_TOKENS=" + n.consoleTokens()}},
		{"alerter", []string{"QF_OPS_ADDR=" + addr["alerter"], "QF_ALERTS_ADDR=127.0.0.1:0", "QF_WEBHOOKS_FILE=" + hooks,
			"QF_CONSUMER=alerter-" + n.run, "QF_DELIVERY_POLL=500ms"}},
		{"admission", []string{"QF_OPS_ADDR=" + addr["admission"], "QF_ADMISSION_ADDR=" + addr["api"],
			"QF_API_TOKENS=" + n.token, "QF_SPILL_DIR=" + filepath.Join(dir, "spill"),
			"QF_GATEWAY_ADDR=" + addr["gateway"], "QF_GATEWAY_UPSTREAM=" + up.URL,
			"QF_GATEWAY_KEYS=" + n.llmKey + "=" + n.llmTenant + "/app",
			// A busy laptop answers Redis in more than the default 10 ms;
			// the demo wants Redis's exact decisions, not local ones.
			"QF_REDIS_TIMEOUT=250ms"}},
	}
	for _, sp := range specs {
		s, err := e2e.Start(sp.name, filepath.Join(binDir, sp.name), dir, addr[sp.name], append(append([]string{}, common...), sp.env...))
		if err != nil {
			return nil, err
		}
		svcs = append(svcs, s)
	}
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	for _, s := range svcs {
		if err := s.WaitReady(rctx); err != nil {
			cancel()
			return nil, err
		}
		fmt.Fprintf(out, "  %-9s ready  %s/readyz (pid %d)\n", s.Name, s.Ops, s.Cmd.Process.Pid)
	}
	cancel()
	if deg := svcs[2].WaitSteady(ctx, 30*time.Second); deg != "" {
		fmt.Fprintf(out, "  admission still degraded, running anyway: %s\n", deg)
	}
	api := "http://" + addr["api"]
	rep.API, rep.APIToken = api, n.token
	fmt.Fprintf(out, "admission API %s, LLM gateway http://%s in front of a stand-in LLM %s, webhook receiver %s\n", api, addr["gateway"], up.URL, recv.URL)
	fmt.Fprintf(out, "tenants %s; policy: 5h quota %d tokens, 10 req/s (burst 20), %s %d requests/day per user\n\n",
		strings.Join(n.tenants, ", "), n.quota5h, n.endpoint, n.dailyReqs)

	st := e2e.NewStats()
	rep.Stats = st
	gen := &e2e.Generator{Base: api, Token: n.token, Endpoint: n.endpoint, Run: n.run, St: st, Patience: time.Second,
		Client: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}}
	fmt.Fprintf(out, "traffic for %v (%d rounds, %d users) ...\n", cfg.Duration, cfg.Rounds, len(demoUsers(n)))
	playTraffic(ctx, out, cfg, gen, demoUsers(n), recv)
	if ctx.Err() != nil {
		fmt.Fprintln(out, "interrupted: summarizing what was sent, then stopping everything")
	}
	fmt.Fprintf(out, "LLM gateway: %d chat completions (half streamed) as tenant %s, no quotaflow code in the caller ...\n", len(llmMix), n.llmTenant)
	rep.Gateway = playGateway(ctx, up, "http://"+addr["gateway"], n.llmKey)

	// Accounter and alerter are asynchronous: wait until the pipeline has
	// delivered everything to the ledger, then give the last alerts a
	// moment.
	sctx := context.WithoutCancel(ctx)
	pipe := e2e.Pipeline{AdmissionOps: []string{svcs[2].Ops}, NATSURL: cfg.NATSURL, Stream: n.stream, Durable: n.durable, DLQ: n.dlq, DBURL: pgURL}
	rep.Ledger, rep.LedgerErr = e2e.WaitLedger(sctx, pipe, st, cfg.SettleTimeout)
	if rep.LedgerErr == nil {
		readGatewayLedger(sctx, rep.Gateway, pgURL, n.llmTenant)
	}
	rep.LedgerMatches = rep.LedgerErr == nil && rep.Ledger.ActualTotal == st.ActualSent.Load()+rep.Gateway.Used
	waitAlertsQuiet(recv, 2*time.Second, 15*time.Second)

	rep.DeniedBy = st.DeniedBy()
	rep.Decisions, err = e2e.Decisions(sctx, svcs[2].Ops)
	if err != nil {
		fmt.Fprintf(out, "cannot read admission metrics: %v\n", err)
	}
	rep.Alerts, rep.Thresholds, rep.BadSignatures, rep.DuplicateAlerts, rep.Refires = recv.Counts()
	thresholds := recv.ThresholdAlerts()
	rep.Unfounded = st.Unfounded(thresholds)
	rep.ByLimit = map[string]int{}
	for _, a := range thresholds {
		rep.ByLimit[strings.TrimSpace(a.Endpoint+" "+a.LimitName)]++
	}
	printSummary(out, rep)
	rep.Console = "http://" + addr["console"] + "/"
	fmt.Fprintf(out, "web console %s  (sign in with the admin token %s)\n", rep.Console, n.console)
	fmt.Fprintf(out, "  or with %s to see what tenant %s alone sees\n", n.tenantC, n.tenants[0])
	if !cfg.Keep {
		fmt.Fprintln(out, "  it stops with the demo now: -keep leaves it up")
	}
	if cfg.visit != nil {
		cfg.visit(rep)
	}

	if cfg.Keep {
		kept = true
		printKept(out, n, api, pgURL, dir, svcs)
	}
	if rep.LedgerErr != nil {
		return rep, rep.LedgerErr
	}
	if !rep.LedgerMatches {
		return rep, errors.New("the ledger's actual total differs from what was sent")
	}
	if !rep.Gateway.Matches() {
		return rep, fmt.Errorf("the LLM gateway's calls in the ledger differ from the stand-in's usage: %s", rep.Gateway)
	}
	if len(rep.Unfounded) > 0 {
		return rep, fmt.Errorf("%d threshold alerts claim more usage than the traffic caused", len(rep.Unfounded))
	}
	return rep, nil
}

// playTraffic runs the generator and prints a progress line every
// cfg.Progress.
func playTraffic(ctx context.Context, out io.Writer, cfg Config, gen *e2e.Generator, us []e2e.User, recv *e2e.Receiver) {
	done := make(chan struct{})
	go func() {
		gen.Play(ctx, us, cfg.Rounds, cfg.Duration)
		close(done)
	}()
	t0 := time.Now()
	tick := time.NewTicker(cfg.Progress)
	defer tick.Stop()
	line := func() {
		st := gen.St
		fmt.Fprintf(out, "[%5.1fs] admits %5d  allowed %5d  429s %5d  5xx %d  actual events %5d  releases %4d  alerts %3d\n",
			time.Since(t0).Seconds(), st.Admits.Load(), st.Allowed.Load(), st.Denied.Load(), st.Status5xx.Load(),
			st.ActualEvents.Load(), st.Releases.Load(), recv.Total())
	}
	for {
		select {
		case <-done:
			line()
			return
		case <-tick.C:
			line()
		}
	}
}

// waitAlertsQuiet returns once no alert arrived for quiet, or after max.
func waitAlertsQuiet(recv *e2e.Receiver, quiet, max time.Duration) {
	deadline := time.Now().Add(max)
	last, lastChange := recv.Total(), time.Now()
	for time.Now().Before(deadline) {
		time.Sleep(250 * time.Millisecond)
		if n := recv.Total(); n != last {
			last, lastChange = n, time.Now()
		} else if time.Since(lastChange) >= quiet {
			return
		}
	}
}

// cleanup stops the services and removes the run's database, streams,
// Redis keys and temp directory.
func cleanup(ctx context.Context, out io.Writer, cfg Config, n names, pgURL, dir string, svcs []*e2e.Service) {
	if len(svcs) > 0 {
		fmt.Fprintln(out, "\nstopping the services ...")
	}
	// Reverse order: admission stops taking requests before the
	// consumers of its events go.
	for i := len(svcs) - 1; i >= 0; i-- {
		if err := svcs[i].Stop(20 * time.Second); err != nil {
			fmt.Fprintf(out, "  %s: %v\n", svcs[i].Name, err)
		}
	}
	if err := dropDatabase(ctx, pgURL); err != nil {
		fmt.Fprintf(out, "  drop database %s: %v\n", n.database, err)
	}
	if err := deleteStreams(ctx, cfg.NATSURL, n); err != nil {
		fmt.Fprintf(out, "  %v\n", err)
	}
	if err := deleteRedisKeys(ctx, cfg.RedisURL, n); err != nil {
		fmt.Fprintf(out, "  redis cleanup: %v\n", err)
	}
	_ = os.RemoveAll(dir)
	fmt.Fprintf(out, "stopped; database %s, streams %s/%s and the run's Redis keys removed\n", n.database, n.stream, n.dlq)
}

// runDir is the run's directory (binaries, policy, logs, spill): derived
// from the run id so that -cleanup finds it.
func runDir(run string) string {
	return filepath.Join(os.TempDir(), "quotaflow-demo-"+run)
}

// cleanupKept removes what a --keep run left, once its services are
// stopped: the run id names everything.
func cleanupKept(ctx context.Context, cfg Config, run string, out io.Writer) error {
	n := namesFor(run)
	pgURL, err := databaseURL(cfg.PostgresURL, n.database)
	if err != nil {
		return err
	}
	cleanup(ctx, out, cfg, n, pgURL, runDir(run), nil)
	return nil
}

func printKept(out io.Writer, n names, api, pgURL, dir string, svcs []*e2e.Service) {
	fmt.Fprintln(out, "\n--keep: the services keep running:")
	fmt.Fprintf(out, "  admission API  %s  (Authorization: Bearer %s)\n", api, n.token)
	var pids []string
	for _, s := range svcs {
		fmt.Fprintf(out, "  %-9s ops  %s/metrics  log %s\n", s.Name, s.Ops, s.LogPath)
		pids = append(pids, strconv.Itoa(s.Cmd.Process.Pid))
	}
	fmt.Fprintf(out, "  ledger         psql '%s'\n", pgURL)
	fmt.Fprintf(out, "  try: curl -s %s/v1/usage?tenant=%s\\&user=heavy -H 'Authorization: Bearer %s'\n", api, n.tenants[0], n.token)
	fmt.Fprintln(out, "  (the webhook receiver lived in this process: alerts now fail and are retried by the alerter)")
	fmt.Fprintf(out, "stop them with:  kill %s\n", strings.Join(pids, " "))
	fmt.Fprintf(out, "then remove its database, streams, Redis keys and files:  go run ./cmd/demo -cleanup %s\n", n.run)
}
