package e2e

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Receiver is the webhook endpoint the alerter delivers to. It verifies
// each delivery's Standard Webhooks signature itself (not with the library
// the alerter signs with, so a shared bug cannot hide), drops repeats by
// webhook-id as a real receiver must, and prints each alert.
type Receiver struct {
	key []byte // the secret's base64 part, decoded
	out io.Writer
	srv *http.Server
	URL string // where the alerter delivers

	mu     sync.Mutex
	seen   map[string]bool // webhook-id
	byKind map[string]int
	thresh map[int]int // threshold alerts by threshold
	bad    int         // deliveries with a missing or wrong signature
	dups   int
	// fired counts threshold alerts per limit and threshold. A limit whose
	// usage fell back or whose window reset fires again: only its first
	// firing is printed.
	fired      map[string]int
	refires    int
	thresholds []ThresholdAlert // every distinct one, in arrival order
}

// ThresholdAlert is what a quota.threshold alert said.
type ThresholdAlert struct {
	Tenant, User, Endpoint, LimitName, Unit string
	Threshold                               int
	Used, Limit                             int64
}

func (a ThresholdAlert) String() string {
	lim := a.LimitName
	if a.Endpoint != "" {
		lim = a.Endpoint + " " + lim
	}
	return fmt.Sprintf("%d%% %s/%s %s at %d/%d %s", a.Threshold, a.Tenant, a.User, lim, a.Used, a.Limit, a.Unit)
}

// NewWebhookSecret returns a fresh Standard Webhooks secret ("whsec_" and
// the base64 of 24 random bytes) for a run's alerter and its Receiver.
func NewWebhookSecret() string {
	key := make([]byte, 24)
	_, _ = rand.Read(key)
	return "whsec_" + base64.StdEncoding.EncodeToString(key)
}

// Webhooks is an alerter webhooks file that sends every alert to the
// Receiver at url, signed with secret, as the webhook name.
func Webhooks(name, url, secret string) string {
	return fmt.Sprintf(`webhooks:
  - name: %s
    url: %s
    secret: %s
    kinds: []
    tenants: []
    allow_private: true   # the receiver is this process, on loopback
`, name, url, secret)
}

// NewReceiver starts a Receiver on a loopback port for the Standard
// Webhooks secret ("whsec_" + base64), printing each new alert to out.
func NewReceiver(secret string, out io.Writer) (*Receiver, error) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		return nil, fmt.Errorf("webhook secret: %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Receiver{key: key, out: out, seen: map[string]bool{}, byKind: map[string]int{}, thresh: map[int]int{}, fired: map[string]int{}}
	r.URL = "http://" + l.Addr().String() + "/hooks/quota"
	r.srv = &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = r.srv.Serve(l) }()
	return r, nil
}

// Verify checks webhook-signature against HMAC-SHA256(id.timestamp.body).
// The header may hold several space-separated "v1,<base64>" signatures
// (during a secret rotation); one match is enough.
func (r *Receiver) Verify(h http.Header, body []byte) error {
	id, ts, sigs := h.Get("webhook-id"), h.Get("webhook-timestamp"), h.Get("webhook-signature")
	if id == "" || ts == "" || sigs == "" {
		return fmt.Errorf("missing webhook headers")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return fmt.Errorf("bad webhook-timestamp")
	}
	// Standard Webhooks asks receivers to refuse stale timestamps (replays).
	if d := time.Since(time.Unix(sec, 0)); d > 5*time.Minute || d < -5*time.Minute {
		return fmt.Errorf("webhook-timestamp %s too far from now", ts)
	}
	m := hmac.New(sha256.New, r.key)
	m.Write([]byte(id + "." + ts + "."))
	m.Write(body)
	want := m.Sum(nil)
	for _, s := range strings.Fields(sigs) {
		v, b64, ok := strings.Cut(s, ",")
		if !ok || v != "v1" {
			continue
		}
		got, err := base64.StdEncoding.DecodeString(b64)
		if err == nil && hmac.Equal(got, want) {
			return nil
		}
	}
	return fmt.Errorf("no valid v1 signature")
}

type alertBody struct {
	Type string          `json:"type"`
	Data json.RawMessage `json:"data"`
}

type alertData struct {
	Tenant     string  `json:"tenant"`
	User       string  `json:"user"`
	Endpoint   string  `json:"endpoint"`
	LimitName  string  `json:"limit_name"`
	Unit       string  `json:"unit"`
	Threshold  int     `json:"threshold"`
	Used       int64   `json:"used"`
	Limit      int64   `json:"limit"`
	Percent    float64 `json:"percent"`
	DenialRate float64 `json:"denial_rate"`
	Denied     int64   `json:"denied"`
	Total      int64   `json:"total"`
	State      string  `json:"state"`
	Key        string  `json:"key"`
}

func (r *Receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(io.LimitReader(req.Body, 1<<20))
	if err != nil {
		http.Error(w, "read", http.StatusBadRequest)
		return
	}
	if err := r.Verify(req.Header, body); err != nil {
		r.mu.Lock()
		r.bad++
		r.mu.Unlock()
		fmt.Fprintf(r.out, "  ! webhook refused: %v\n", err)
		http.Error(w, err.Error(), http.StatusUnauthorized)
		return
	}
	var a alertBody
	var d alertData
	if json.Unmarshal(body, &a) != nil || json.Unmarshal(a.Data, &d) != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	id := req.Header.Get("webhook-id")
	dup, again := r.seen[id], false
	if dup {
		r.dups++
	} else {
		r.seen[id] = true
		r.byKind[a.Type]++
		if a.Type == "quota.threshold" {
			r.thresh[d.Threshold]++
			r.thresholds = append(r.thresholds, ThresholdAlert{Tenant: d.Tenant, User: d.User, Endpoint: d.Endpoint,
				LimitName: d.LimitName, Unit: d.Unit, Threshold: d.Threshold, Used: d.Used, Limit: d.Limit})
			k := fmt.Sprintf("%s/%s/%s/%s/%d", d.Tenant, d.User, d.Endpoint, d.LimitName, d.Threshold)
			r.fired[k]++
			if again = r.fired[k] > 1; again {
				r.refires++
			}
		}
	}
	r.mu.Unlock()
	// 2xx for a repeat too: the alerter must stop retrying it.
	w.WriteHeader(http.StatusNoContent)
	if !dup && !again {
		fmt.Fprintf(r.out, "  ✉ %s\n", describeAlert(a.Type, d))
	}
}

func describeAlert(kind string, d alertData) string {
	who := d.Tenant
	if d.User != "" {
		who += "/" + d.User
	}
	switch kind {
	case "quota.threshold":
		lim := d.LimitName
		if d.Endpoint != "" {
			lim = d.Endpoint + " " + lim
		}
		return fmt.Sprintf("alert quota.threshold %d%%: %s %s at %d/%d %s (%.0f%%), signature ok",
			d.Threshold, who, lim, d.Used, d.Limit, d.Unit, d.Percent)
	case "quota.denial_spike":
		if who == "" {
			who = d.Endpoint
		}
		return fmt.Sprintf("alert quota.denial_spike %s: %s denied %d of %d (%.0f%%), signature ok",
			d.State, who, d.Denied, d.Total, d.DenialRate*100)
	case "quota.abuse_suspected":
		return fmt.Sprintf("alert quota.abuse_suspected: %s %s denied %d times, signature ok", d.Key, who, d.Denied)
	}
	return "alert " + kind + ", signature ok"
}

// Counts returns a copy of the tallies.
func (r *Receiver) Counts() (byKind map[string]int, thresh map[int]int, bad, dups, refires int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	byKind, thresh = map[string]int{}, map[int]int{}
	for k, v := range r.byKind {
		byKind[k] = v
	}
	for k, v := range r.thresh {
		thresh[k] = v
	}
	return byKind, thresh, r.bad, r.dups, r.refires
}

// ThresholdAlerts returns the distinct quota.threshold alerts received.
func (r *Receiver) ThresholdAlerts() []ThresholdAlert {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.thresholds)
}

// Total is the number of distinct alerts received.
func (r *Receiver) Total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, v := range r.byKind {
		n += v
	}
	return n
}

// Close stops the receiver.
func (r *Receiver) Close() { _ = r.srv.Close() }

// IDs returns the webhook-ids of every delivery received.
func (r *Receiver) IDs() map[string]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	ids := make(map[string]bool, len(r.seen))
	for k := range r.seen {
		ids[k] = true
	}
	return ids
}
