package llmproxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/obs"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/openai"
)

// Admitter decides, releases and charges for the proxy: *httpapi.Handler,
// so a proxied request goes through the code of POST /v1/admit,
// /v1/release and /v1/usage.
type Admitter interface {
	AdmitTokens(ctx context.Context, in decide.Input, input, output int64) httpapi.Admission
	Release(ctx context.Context, tenant, user, requestID string) error
	ReportActual(ctx context.Context, a events.Actual) error
}

// Options configure a Proxy. Config and Admitter are required.
type Options struct {
	// Config returns the configuration in force (Watcher.Current).
	Config func() *Config
	// Admitter decides and charges (*httpapi.Handler).
	Admitter Admitter
	// DefaultMaxTokens is set on a request without an output maximum
	// (default DefaultMaxTokens).
	DefaultMaxTokens int64
	// ReferenceTokens are counted for each file part and stored context a
	// request points to (openai.Options.ReferenceTokens; default
	// openai.DefaultReferenceTokens).
	ReferenceTokens int64
	// Transport reaches the upstreams (default: a transport without
	// compression, so that streams are read as they come).
	Transport http.RoundTripper
	// SettleTimeout bounds admitting a request, and releasing or reporting
	// it after it ended, each on a context detached from the client's
	// (default 10 s).
	SettleTimeout time.Duration
	// BufferBudget bounds the bytes of all the non-stream answers held at
	// once to read their usage (default DefaultBufferBudget), each
	// tenant's to half of it; an answer that would pass either is passed
	// through and charged the estimate.
	BufferBudget int64
	// InspectBudget bounds the memory of the request bodies being read and
	// inspected at once (default DefaultInspectBudget), each tenant's to
	// half of it: a request takes inspectCost of its declared length, and
	// one past either is answered 503 with Retry-After. Once inspected, it
	// keeps the length of the copy sent upstream until the upstream read
	// it and answered. A passed-through body counts too, its declared
	// length once, until the upstream read it and answered.
	InspectBudget int64
	// WriteTimeout bounds each write to a client (default 30 s): one that
	// takes nothing for this long is dropped, and the upstream request
	// with it.
	WriteTimeout time.Duration
	// Log receives failures and per-request debug lines (never a key); nil
	// discards them.
	Log *slog.Logger
	// Registerer receives the proxy's metrics; nil registers nothing.
	Registerer prometheus.Registerer
}

// Proxy is the OpenAI-compatible reverse proxy. Each request to a metered
// endpoint (/v1/chat/completions, /v1/completions, /v1/embeddings,
// /v1/responses) is
//
//  1. identified: by its bearer key, or by trusted headers from an outer
//     gateway (401 otherwise);
//  2. estimated (openai.Inspect): input tokens counted, output as n ×
//     the maximum, the configured default maximum set when it has none,
//     and stream_options.include_usage set on a stream;
//  3. admitted through POST /v1/admit's decision (429 with its headers and
//     an OpenAI-style error body when denied);
//  4. forwarded to the model's upstream with the upstream's key, every
//     chunk of a stream written and flushed as it comes, reading no more
//     from the upstream than the client takes (back-pressure) and on the
//     client's context (its leaving cancels the upstream request);
//  5. settled once its answer is complete, on a context detached from the
//     client's, by a goroutine the Proxy owns (Close waits for it): the usage the
//     upstream reported is charged (the actual event of POST /v1/usage);
//     without one, the input and the output streamed so far; nothing
//     produced (the upstream failed, or the client left, before any token)
//     releases the reservation.
//
// Other paths are passed to the default upstream unmetered when the file
// lists them (pass), and refused with 404 otherwise. Create a Proxy with
// New; it is safe for concurrent use.
type Proxy struct {
	cfg       func() *Config
	adm       Admitter
	inspect   openai.Options
	transport http.RoundTripper
	settleTO  time.Duration
	writeTO   time.Duration
	buffers   budget
	bodies    budget // Options.InspectBudget
	log       *slog.Logger
	requests  *prometheus.CounterVec
	settled   *prometheus.CounterVec
	mu        sync.Mutex
	closed    bool           // Close was called: no request is admitted
	settling  sync.WaitGroup // admitted requests until settled, waited for by Close
}

// Settlement outcomes, the labels of quotaflow_admission_gateway_settled_total.
const (
	settledUsage    = "usage"    // the upstream's usage charged
	settledCounted  = "counted"  // no usage came: input and the streamed output charged
	settledEstimate = "estimate" // a response without usage: the estimate charged
	settledReleased = "released" // nothing produced: released
)

// New returns the proxy.
func New(o Options) (*Proxy, error) {
	if o.Config == nil || o.Admitter == nil {
		return nil, errors.New("llmproxy: Config and Admitter are required")
	}
	if o.DefaultMaxTokens <= 0 {
		o.DefaultMaxTokens = DefaultMaxTokens
	}
	if o.Transport == nil {
		o.Transport = newTransport()
	}
	if o.SettleTimeout <= 0 {
		o.SettleTimeout = 10 * time.Second
	}
	if o.BufferBudget <= 0 {
		o.BufferBudget = DefaultBufferBudget
	}
	if o.InspectBudget <= 0 {
		o.InspectBudget = DefaultInspectBudget
	}
	if o.WriteTimeout <= 0 {
		o.WriteTimeout = 30 * time.Second
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{
		cfg: o.Config, adm: o.Admitter, inspect: openai.Options{DefaultMaxTokens: o.DefaultMaxTokens, ReferenceTokens: o.ReferenceTokens},
		transport: o.Transport, settleTO: o.SettleTimeout, writeTO: o.WriteTimeout, log: o.Log.With("component", "gateway"),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_gateway_requests_total",
			Help: "Requests the LLM gateway answered, by status class (2xx, 4xx, 5xx).",
		}, []string{"code"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_gateway_settled_total",
			Help: "Admitted gateway requests by how they were settled: usage (reported by the upstream), counted (input and streamed output), estimate (no usage in a response), released (nothing produced).",
		}, []string{"result"}),
	}
	p.buffers = budget{left: o.BufferBudget, share: o.BufferBudget / 2, held: map[string]int64{}}
	p.bodies = budget{left: o.InspectBudget, share: o.InspectBudget / 2, held: map[string]int64{}}
	for _, c := range obs.CodeClasses {
		p.requests.WithLabelValues(c)
	}
	for _, r := range []string{settledUsage, settledCounted, settledEstimate, settledReleased} {
		p.settled.WithLabelValues(r)
	}
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{p.requests, p.settled} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("llmproxy: %w", err)
			}
		}
	}
	return p, nil
}

// DefaultBufferBudget is Options.BufferBudget's default: four answers of
// maxResponse (two of one tenant's), or thousands of ordinary ones.
const DefaultBufferBudget = 256 << 20

// DefaultInspectBudget is Options.InspectBudget's default: sixteen bodies
// of the largest size at once (eight of one tenant's), or thousands of
// ordinary ones.
const DefaultInspectBudget = 16 * inspectCost * openai.DefaultMaxBody

// inspectCost is the memory a body of n bytes takes while it is read and
// inspected, n bytes at a time: the bytes themselves, what decoding its
// messages makes, and the rewritten copy (openai.Inspect).
const inspectCost = 4

// newTransport is the default Transport: no compression (a gzip reader
// would hold stream chunks back), bounded connection set-up, and no
// overall timeout, since a long answer may take minutes.
func newTransport() *http.Transport {
	return &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   10 * time.Second,
		DisableCompression:    true,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
}

// ServeHTTP proxies one request (see Proxy).
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Every write sets its own deadline (Options.WriteTimeout) instead of
	// the server's whole-response WriteTimeout, which would cut long streams.
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Time{})
	cw := &countingWriter{ResponseWriter: w, rc: rc, timeout: p.writeTO}
	p.serve(cw, r)
	code := cw.code
	if code == 0 {
		code = 499 // nothing written: the client left
	}
	p.requests.WithLabelValues(obs.CodeClass(code)).Inc()
}

func (p *Proxy) serve(w *countingWriter, r *http.Request) {
	if !canonical(r.URL) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_path",
			"path: must be clean (no '.' or '..' segment, no '//', no trailing '/') and escape no '/' or '.'")
		return
	}
	cfg := p.cfg()
	id, ok := cfg.identify(r)
	if !ok {
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "missing or unknown API key")
		return
	}
	kind, metered := openai.KindOf(r.URL.Path)
	switch {
	case !metered && cfg.passes(r.URL.Path) && cfg.fallback != nil:
		p.pass(w, r, cfg.fallback, id.Tenant)
		return
	case !metered:
		writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_url", "unknown path: this gateway serves "+
			"/v1/chat/completions, /v1/completions, /v1/embeddings and /v1/responses")
		return
	case r.Method != http.MethodPost:
		w.Header().Set("Allow", http.MethodPost)
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "use POST")
		return
	}
	taken, ok := p.takeBody(w, r, id.Tenant, inspectCost)
	if !ok {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, openai.DefaultMaxBody+1))
	if err != nil {
		p.bodies.give(id.Tenant, taken)
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_body", "body: could not be read")
		return
	}
	req, err := openai.Inspect(kind, body, p.inspect)
	free := p.keepBody(id.Tenant, taken, int64(len(req.Body)))
	defer free()
	sent := newSentBody(req.Body, free)
	req.Body = nil // the exchange outlives the upstream's reading it
	switch {
	case errors.Is(err, openai.ErrTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", err.Error())
		return
	case err != nil:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_request", err.Error())
		return
	}
	up := cfg.route(req.Model)
	if up == nil {
		writeError(w, http.StatusNotFound, "invalid_request_error", "model_not_found", "model: no upstream serves it")
		return
	}
	in := decide.Input{Tenant: id.Tenant, User: id.User, Endpoint: r.URL.Path, Model: req.Model}
	if cfg.trusted == nil || !cfg.trusted.from(r.RemoteAddr) {
		in.IP = peerIP(r.RemoteAddr) // an outer gateway's address is not its clients'
	}
	if !p.enter() {
		writeError(w, http.StatusServiceUnavailable, "api_error", "shutting_down", "the gateway is shutting down")
		return
	}
	// Settled however the handler ends (a panic in forward included), after
	// it returned: a stream's body ends without waiting for the charge.
	var x *exchange
	var o outcome
	defer func() {
		if x == nil {
			p.settling.Done() // not admitted: nothing to settle
			return
		}
		go func() {
			defer p.settling.Done()
			x.settle(o)
		}()
	}()
	// Detached from the client's context: a client leaving while Redis
	// reserves would otherwise lose the answer and leave the reservation
	// held; the decision completes and is released below instead.
	actx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), p.settleTO)
	adm := p.adm.AdmitTokens(actx, in, req.InputTokens, req.OutputTokens)
	cancel()
	for k, v := range adm.Header {
		w.Header()[k] = v
	}
	switch adm.Status {
	case http.StatusOK:
	case http.StatusTooManyRequests:
		typ, code := "rate_limit_exceeded", "rate_limit_exceeded"
		if r := limits.Reason(adm.Reason); r == limits.ReasonCostExceedsLimit || r == limits.ReasonInsufficientBalance {
			// Waiting does not help: the SDKs must not retry.
			w.Header().Set("X-Should-Retry", "false")
			typ, code = "insufficient_quota", adm.Reason
		}
		writeError(w, http.StatusTooManyRequests, typ, code, adm.Message)
		return
	case http.StatusBadRequest:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_request", adm.Message)
		return
	default:
		p.log.Error("admission answered unexpectedly", "status", adm.Status, "message", adm.Message)
		writeError(w, http.StatusInternalServerError, "api_error", "internal_error", "admission failed")
		return
	}
	x = &exchange{p: p, id: id, req: req, kind: kind, path: r.URL.Path, requestID: adm.RequestID}
	if r.Context().Err() != nil {
		return // the client left while admission decided: released
	}
	o = p.forward(w, r, up, sent, x)
}

// takeBody takes the memory r's body will hold, cost bytes for each byte,
// from tenant's share of the bodies budget before it is read: a key's
// holder sending many large bodies at once must not take the process (and
// every other tenant's requests) down with it. An unknown length counts as
// the cap. When the budget or the share is exhausted it answers 503 with
// Retry-After and returns false.
func (p *Proxy) takeBody(w *countingWriter, r *http.Request, tenant string, cost int64) (taken int64, ok bool) {
	size := r.ContentLength
	if size < 0 || size > openai.DefaultMaxBody {
		size = openai.DefaultMaxBody
	}
	taken = cost * size
	if !p.bodies.take(tenant, taken) {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "api_error", "overloaded", "too many large requests are being read: retry shortly")
		return 0, false
	}
	return taken, true
}

// keepBody keeps n of the bytes takeBody took counted for the copy sent
// upstream, and gives back the rest now; free gives back the kept bytes,
// once: when nothing holds the copy (sentBody), at the latest when the
// request ends.
func (p *Proxy) keepBody(tenant string, taken, n int64) (free func()) {
	kept := min(n, taken)
	p.bodies.give(tenant, taken-kept)
	return sync.OnceFunc(func() { p.bodies.give(tenant, kept) })
}

// enter counts a request about to be admitted, so that Close waits for its
// settlement; false once Close was called.
func (p *Proxy) enter() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.settling.Add(1)
	return true
}

// Close refuses to admit any more requests (503) and waits until every
// request admitted so far is settled (charged or released), or ctx ends.
// Call it after the server stopped taking requests and before the
// Admitter's Decider and outbox close.
func (p *Proxy) Close(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	done := make(chan struct{})
	go func() { p.settling.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("llmproxy: settling requests: %w", ctx.Err())
	}
}

// canonical reports whether u's path is the one path it names: absolute,
// clean, and without a non-default escape (%2F, %2e: url.URL keeps those in
// RawPath). Anything else could name a metered endpoint through a passed
// prefix (/v1/models/../chat/completions) or be read differently upstream,
// and the gateway has no ServeMux to clean it.
func canonical(u *url.URL) bool {
	p := u.Path
	return u.RawPath == "" && strings.HasPrefix(p, "/") && path.Clean(p) == p
}

// exchange is one admitted request on its way through the upstream.
type exchange struct {
	p         *Proxy
	id        Identity
	req       openai.Request
	kind      openai.Kind
	path      string
	requestID string
}

// outcome is what an exchange produced.
type outcome struct {
	usage    openai.Usage
	reported bool // usage is the upstream's
	produced bool // the upstream answered 2xx and something was produced
	estimate bool // a 2xx answer without usage: charge the estimate
}

// settle charges or releases the exchange on a context detached from the
// client's, so that its leaving cannot lose the charge.
func (x *exchange) settle(o outcome) {
	ctx, cancel := context.WithTimeout(context.Background(), x.p.settleTO)
	defer cancel()
	log := x.p.log.With("request_id", x.requestID)
	if !o.produced {
		x.p.settled.WithLabelValues(settledReleased).Inc()
		if err := x.p.adm.Release(ctx, x.id.Tenant, x.id.User, x.requestID); err != nil {
			log.Warn("release failed; the reservation expires instead", "err", err)
		}
		return
	}
	a := events.Actual{RequestID: x.requestID, Tenant: x.id.Tenant, User: x.id.User, Endpoint: x.path, Model: x.req.Model}
	result := settledUsage
	switch {
	case o.reported:
		a.InputTokens, a.OutputTokens = o.usage.Input, o.usage.Output
	case o.estimate:
		a.InputTokens, a.OutputTokens, result = x.req.InputTokens, x.req.OutputTokens, settledEstimate
	default:
		a.InputTokens, a.OutputTokens, result = x.req.InputTokens, o.usage.Output, settledCounted
	}
	x.p.settled.WithLabelValues(result).Inc()
	if err := x.p.adm.ReportActual(ctx, a); err != nil {
		log.Warn("actual usage not stored by the stream yet; the outbox retries it", "err", err)
	}
}

// maxResponse bounds each non-stream response read whole for its usage (64
// MiB: an embeddings answer of 2048 inputs of 3072 dimensions is ~60 MB);
// past it the rest is passed through and the estimate charged.
const maxResponse = 64 << 20

// forward sends body to up and copies the answer to w, metering it.
func (p *Proxy) forward(w *countingWriter, r *http.Request, up *Upstream, body *sentBody, x *exchange) outcome {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	resp, err := p.roundTrip(ctx, r, up, body)
	if err != nil {
		if r.Context().Err() == nil {
			p.log.Warn("upstream unreachable", "upstream", up.Name, "err", err)
			writeError(w, http.StatusBadGateway, "api_error", "upstream_error", "the upstream could not be reached")
		}
		return outcome{}
	}
	defer resp.Body.Close()
	if p.refused(w, resp, up) {
		return outcome{}
	}
	copyHeader(w.Header(), resp.Header)
	if resp.StatusCode/100 != 2 {
		// An error produces no tokens: release, and pass the answer on.
		w.WriteHeader(resp.StatusCode)
		p.copy(w, resp.Body, nil, cancel)
		return outcome{}
	}
	if x.req.Stream && isEventStream(resp.Header) {
		w.Header().Del("Content-Length") // the usage chunk may be stripped
		w.WriteHeader(resp.StatusCode)
		m := openai.NewMeter(x.kind, x.req.Model, !x.req.IncludeUsage)
		if p.copy(w, resp.Body, m.Feed, cancel) {
			w.write(m.Flush()) // an event the upstream left unfinished
		}
		u, reported := m.Usage()
		return outcome{usage: u, reported: reported, produced: reported || u.Output > 0}
	}
	b, taken, whole := p.buffer(resp.Body, x.id.Tenant)
	defer p.buffers.give(x.id.Tenant, taken)
	w.WriteHeader(resp.StatusCode)
	w.write(b)
	if !whole {
		p.copy(w, resp.Body, nil, cancel)
		return outcome{produced: true, estimate: true}
	}
	u, ok := openai.UsageOf(x.kind, b)
	return outcome{usage: u, reported: ok, produced: true, estimate: !ok}
}

// buffer reads a non-stream answer of tenant whole for its usage while it
// stays under maxResponse and the budget for buffered answers lasts (at
// most one more read each). It returns what it read, the budget it took
// (to give back once written) and whether that is the whole answer; when
// not, the caller passes the rest through and charges the estimate.
func (p *Proxy) buffer(src io.Reader, tenant string) (b []byte, taken int64, whole bool) {
	chunk := make([]byte, 32<<10)
	for {
		n, err := src.Read(chunk)
		if n > 0 {
			b = append(b, chunk[:n]...)
			if len(b) > maxResponse || !p.buffers.take(tenant, int64(n)) {
				return b, taken, false
			}
			taken += int64(n)
		}
		if err == io.EOF {
			return b, taken, true
		}
		if err != nil {
			return b, taken, false
		}
	}
}

// budget is memory the tenants' requests share (Options.BufferBudget,
// Options.InspectBudget): the bytes left, and those each tenant holds, at
// most share, half of it, so that one tenant's clients cannot exhaust it
// for the others. A buffered answer's bytes are held until its client took
// them, which a client that does not read delays by up to the write
// timeout (giving them back before would leave the memory unbounded); so
// without shares one tenant could make every other tenant's answers
// charged their estimate.
type budget struct {
	mu          sync.Mutex
	left, share int64
	held        map[string]int64 // by tenant, while it holds any
}

// take takes n bytes for tenant, or nothing and false when that would pass
// the budget or the tenant's share.
func (b *budget) take(tenant string, n int64) bool {
	if n == 0 {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if n > b.left || b.held[tenant]+n > b.share {
		return false
	}
	b.left -= n
	b.held[tenant] += n
	return true
}

// give gives back n bytes tenant took.
func (b *budget) give(tenant string, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.left += n
	if b.held[tenant] -= n; b.held[tenant] == 0 {
		delete(b.held, tenant)
	}
}

// pass forwards a passed path to up unmetered. Its body is held in memory
// as an inspected one is (the transport may resend it), so it counts in
// the same budget, under tenant's share.
func (p *Proxy) pass(w *countingWriter, r *http.Request, up *Upstream, tenant string) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	taken, ok := p.takeBody(w, r, tenant, 1)
	if !ok {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, openai.DefaultMaxBody+1))
	if err != nil || len(body) > openai.DefaultMaxBody {
		p.bodies.give(tenant, taken)
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", "body: too large or unreadable")
		return
	}
	free := p.keepBody(tenant, taken, int64(len(body)))
	defer free()
	resp, err := p.roundTrip(ctx, r, up, newSentBody(body, free))
	if err != nil {
		if r.Context().Err() == nil {
			writeError(w, http.StatusBadGateway, "api_error", "upstream_error", "the upstream could not be reached")
		}
		return
	}
	defer resp.Body.Close()
	if p.refused(w, resp, up) {
		return
	}
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	p.copy(w, resp.Body, nil, cancel)
}

// refused answers 502 when the upstream refused the gateway's own key (401
// or 403): the caller cannot fix it, and the upstream's answer may repeat
// the key. It reports whether it answered.
func (p *Proxy) refused(w *countingWriter, resp *http.Response, up *Upstream) bool {
	if resp.StatusCode != http.StatusUnauthorized && resp.StatusCode != http.StatusForbidden {
		return false
	}
	p.log.Error("the upstream refused the gateway's key", "upstream", up.Name, "status", resp.StatusCode)
	writeError(w, http.StatusBadGateway, "api_error", "upstream_auth", "the upstream refused the gateway's credentials")
	return true
}

// callerCredentials are the caller's credentials, never sent upstream: the
// gateway key (Bearer, or api-key / x-api-key as Azure and Anthropic
// clients send it) and cookies.
var callerCredentials = []string{"Authorization", "Api-Key", "X-Api-Key", "Cookie"}

// roundTrip sends r's method, query and end-to-end headers with body to
// up: the path after /v1 appended to the upstream's base URL, the
// upstream's key in its auth header instead of the caller's credentials,
// no hop-by-hop headers. The transport retries (a kept-alive connection
// the upstream had closed) within RoundTrip, and follows no redirect: once
// it returns, body is dropped.
func (p *Proxy) roundTrip(ctx context.Context, r *http.Request, up *Upstream, body *sentBody) (*http.Response, error) {
	defer body.drop()
	u := *up.base
	u.Path += strings.TrimPrefix(r.URL.Path, "/v1")
	u.RawQuery = r.URL.RawQuery
	out, err := http.NewRequestWithContext(ctx, r.Method, u.String(), http.NoBody)
	if err != nil {
		return nil, err
	}
	if n := int64(len(body.b)); n > 0 {
		out.Body, _ = body.reader() // not dropped yet: cannot fail
		out.GetBody, out.ContentLength = body.reader, n
	}
	copyHeader(out.Header, r.Header)
	for _, h := range append(callerCredentials, up.authHeader) {
		out.Header.Del(h)
	}
	out.Header.Del("Accept-Encoding") // answers are read: no compression
	switch {
	case up.apiKey == "":
	case up.authHeader == "Authorization":
		out.Header.Set("Authorization", "Bearer "+up.apiKey)
	default:
		out.Header.Set(up.authHeader, up.apiKey)
	}
	return p.transport.RoundTrip(out)
}

// sentBody is a request body on its way upstream. The transport keeps the
// request, with its Body and GetBody, until the response body is closed
// (a stream's whole length), so neither holds the bytes: each reader lets
// go of them at its end (EOF or Close), the sentBody once dropped; when
// nothing holds them, free gives back the budget they were counted in.
type sentBody struct {
	mu      sync.Mutex
	b       []byte // for new readers, until dropped
	dropped bool
	holds   int // the sentBody's until dropped, and each reader's until its end
	free    func()
}

// newSentBody sends b, counted in a budget that free gives back.
func newSentBody(b []byte, free func()) *sentBody {
	return &sentBody{b: b, holds: 1, free: free}
}

var errDropped = errors.New("llmproxy: the request body was already sent")

// reader is a new reader of the body (the request's GetBody).
func (s *sentBody) reader() (io.ReadCloser, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dropped {
		return nil, errDropped
	}
	s.holds++
	return &bodyReader{s: s, b: s.b}, nil
}

// drop lets go of the bytes but for the readers still reading them.
func (s *sentBody) drop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.dropped {
		s.b, s.dropped = nil, true
		s.let()
	}
}

// let ends a hold (s.mu held): the last gives the budget back.
func (s *sentBody) let() {
	if s.holds--; s.holds == 0 {
		s.free()
	}
}

// bodyReader reads a sentBody once. Read and Close may come from
// different goroutines (the transport's writer, and a cancellation).
type bodyReader struct {
	s     *sentBody
	b     []byte // what is left to read
	ended bool
}

func (r *bodyReader) Read(p []byte) (int, error) {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if r.ended {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	if r.b = r.b[n:]; len(r.b) > 0 {
		return n, nil
	}
	r.end()
	return n, io.EOF
}

func (r *bodyReader) Close() error {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if !r.ended {
		r.end()
	}
	return nil
}

// end lets go of the bytes (r.s.mu held).
func (r *bodyReader) end() {
	r.b, r.ended = nil, true
	r.s.let()
}

// copy copies src to w, through feed when set, flushing after each read so
// that every chunk reaches the client as it comes; a write waits for the
// client (at most Options.WriteTimeout), so no more is read from the
// upstream than the client takes. A failed write cancels the upstream
// request (cancel) and returns false: the client is gone.
func (p *Proxy) copy(w *countingWriter, src io.Reader, feed func([]byte) []byte, cancel context.CancelFunc) bool {
	buf := make([]byte, 32<<10)
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			if feed != nil {
				chunk = feed(chunk)
			}
			if len(chunk) > 0 {
				if !w.write(chunk) || w.rc.Flush() != nil {
					cancel()
					return false
				}
			}
		}
		if rerr != nil {
			return true
		}
	}
}

// hopByHop are the headers of one connection (RFC 9110 §7.6.1), never
// forwarded; so are the ones a Connection header names.
var hopByHop = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// copyHeader adds src's end-to-end headers to dst.
func copyHeader(dst, src http.Header) {
	skip := map[string]bool{}
	for _, h := range hopByHop {
		skip[h] = true
	}
	for _, v := range src.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			skip[http.CanonicalHeaderKey(strings.TrimSpace(f))] = true
		}
	}
	for k, vs := range src {
		if !skip[k] {
			dst[k] = append(dst[k], vs...)
		}
	}
}

func isEventStream(h http.Header) bool {
	t, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	return t == "text/event-stream"
}

// errorBody is an OpenAI-style error, which the SDKs parse.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

// writeError writes an OpenAI-style error answer.
func writeError(w *countingWriter, status int, typ, code, msg string) {
	var e errorBody
	e.Error.Message, e.Error.Type, e.Error.Code = msg, typ, code
	b, _ := json.Marshal(e) // strings only: cannot fail
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	w.write(append(b, '\n'))
}

// countingWriter records the status for the requests metric and bounds
// each write.
type countingWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	code    int
}

func (c *countingWriter) WriteHeader(code int) {
	if c.code == 0 {
		c.code = code
	}
	c.ResponseWriter.WriteHeader(code)
}

// write writes b, waiting at most the write timeout for a client that
// does not read, and reports whether all of it went.
func (c *countingWriter) write(b []byte) bool {
	if c.code == 0 {
		c.code = http.StatusOK
	}
	_ = c.rc.SetWriteDeadline(time.Now().Add(c.timeout))
	_, err := c.ResponseWriter.Write(b)
	return err == nil
}

func (c *countingWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// peerIP is the client's address for the IP layer ("" when unknown).
func peerIP(remoteAddr string) string {
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return ""
	}
	return ap.Addr().Unmap().String()
}
