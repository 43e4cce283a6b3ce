// Package detect turns usage events into alerts (docs/design.md §7):
//
//   - quota.threshold when a user- or tenant-scope limit reaches one of
//     the percentages its policy sets (Detector.SetPolicy; by default 80,
//     90 and 100 for quotas, none for token buckets and concurrency)
//     (Detector.Reserved, Detector.Corrected);
//   - quota.denial_spike, firing and resolved, when the denial rate of a
//     tenant or of an endpoint over a sliding window passes a rate with
//     enough requests (Detector.Evaluate);
//   - quota.abuse_suspected for a burst of denials from one subject or IP
//     (Detector.Evaluate).
//
// Threshold, spike and abuse-burst state lives in Postgres (package
// store) and changes in the same transaction that queues the alert in the
// outbox, so a restart neither repeats an alert nor forgets one. Rate counters are in
// memory: after a restart they refill from new events.
package detect

import (
	"encoding/json"
	"time"
)

// Alert kinds: the "type" of a webhook body and the kind label of
// quotaflow_alerts_total.
const (
	KindThreshold = "quota.threshold"
	KindSpike     = "quota.denial_spike"
	KindAbuse     = "quota.abuse_suspected"
)

// Kinds lists every alert kind.
var Kinds = []string{KindThreshold, KindSpike, KindAbuse}

// Spike states of SpikeData.State.
const (
	StateFiring   = "firing"
	StateResolved = "resolved"
)

// Body is a webhook body in the Standard Webhooks shape.
type Body struct {
	Type      string    `json:"type"`      // the alert kind
	Timestamp time.Time `json:"timestamp"` // when the alert was raised (RFC 3339)
	Data      any       `json:"data"`      // ThresholdData, SpikeData or AbuseData
}

// ThresholdData is the data of a quota.threshold alert.
type ThresholdData struct {
	Tenant       string    `json:"tenant"`             // the limit's tenant
	User         string    `json:"user"`               // empty for tenant-scope limits
	Scope        string    `json:"scope"`              // "user" or "tenant"
	Endpoint     string    `json:"endpoint,omitempty"` // set for an endpoint's per-user limit
	LimitName    string    `json:"limit_name"`         // the limit's name in the policy
	Unit         string    `json:"unit"`               // "tokens" or "requests"
	Threshold    int       `json:"threshold"`          // the percentage crossed, 1 to 100
	Used         int64     `json:"used"`               // used in the window, in Unit
	Limit        int64     `json:"limit"`              // the limit, in Unit
	Percent      float64   `json:"percent"`            // used/limit in percent, 0 to 100
	ResetSeconds int64     `json:"reset_seconds"`      // as in the snapshot
	OccurredAt   time.Time `json:"occurred_at"`        // time of the event that crossed
}

// SpikeData is the data of a quota.denial_spike alert. A tenant's spike
// has Endpoint empty; an endpoint's spike (over all tenants) has Tenant
// empty.
type SpikeData struct {
	Tenant        string  `json:"tenant"`         // empty for an endpoint's spike
	Endpoint      string  `json:"endpoint"`       // empty for a tenant's spike
	DenialRate    float64 `json:"denial_rate"`    // denied/total, 0 to 1
	Denied        int64   `json:"denied"`         // denials in the window
	Total         int64   `json:"total"`          // allowed + denied requests in the window
	WindowSeconds int64   `json:"window_seconds"` // the window's span
	State         string  `json:"state"`          // firing or resolved
}

// AbuseData is the data of a quota.abuse_suspected alert: Key says whether
// the burst came from one subject (tenant and user set) or one IP (ip set).
type AbuseData struct {
	Key           string    `json:"key"`            // "subject" or "ip"
	Tenant        string    `json:"tenant"`         // the subject's tenant; empty for an IP
	User          string    `json:"user"`           // the subject's user; empty for an IP
	IP            string    `json:"ip"`             // the IP; empty for a subject
	Denied        int64     `json:"denied"`         // denials in the window
	WindowSeconds int64     `json:"window_seconds"` // the window's span
	OccurredAt    time.Time `json:"occurred_at"`    // when the burst was detected
}

func body(kind string, at time.Time, data any) ([]byte, error) {
	return json.Marshal(Body{Type: kind, Timestamp: at.UTC().Truncate(time.Millisecond), Data: data})
}
