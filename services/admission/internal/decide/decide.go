package decide

import (
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Input is one admission request, already validated by the HTTP layer.
type Input struct {
	RequestID string // never empty: the HTTP layer generates one when absent
	// CallerID says the caller chose RequestID, so it may be a retry of a
	// request admitted before: when a shared layer denies it, Admit asks
	// Redis whether it was (one more round trip, on that path only).
	CallerID bool
	// Fresh says every call is a new request (/v1/authz): a request id that
	// any reservation holds, open or settled, is a denial
	// (limits.ReasonRequestIDReused), never a replayed allow.
	Fresh    bool
	Tenant   string
	User     string
	Plan     string // empty: the tenant's plan, then the policy's default
	IP       string // empty: no IP layer
	Endpoint string
	Model    string
	Cost     int64 // weighted tokens
	// Room, when not nil, is where Admit puts the Result's Limits if they
	// fit, instead of a new array: a caller done with each Result before it
	// uses Room again saves that allocation (the HTTP API pools rooms).
	Room *[RoomLimits]LimitState
}

// RoomLimits is how many limits an Input's Room holds.
const RoomLimits = 8

// Result is the decision on one Input.
type Result struct {
	Allowed   bool
	Duplicate bool        // the request id was admitted before; nothing more reserved
	DeniedBy  *LimitState // the first limit that denied, nil when allowed
	Reason    limits.Reason
	// RetryAfter is how long until the request would fit; zero when waiting
	// does not help (Reason says why).
	RetryAfter time.Duration
	// Limits are every limit that applied, in checking order, after the
	// decision. With a denial, the layers after the denying one were not
	// checked and are absent (so are limits of the denying layer that were
	// not reached: leased limits are checked before the layer's Redis call).
	// Empty when everything is allowed past Options.FailOpenAfter.
	Limits []LimitState
	// Local is set when the decision was made without Redis ("failopen" in
	// metrics): from the local limiter, or allowing all past the outage limit.
	Local        bool
	ShadowDenied bool // a shadow limit would have denied
	Plan         string
	// Rules are the rules the decision applied, as Policy.Resolve gave
	// them under the policy the decider used (read them, never modify
	// them): the answer's headers take each limit's window from them
	// without resolving again.
	Rules         policy.Resolved
	Version       int64 // the subject's version (0 when decided locally)
	TenantVersion int64
	ExpiresAt     time.Time // when the reservation lapses unless settled; set when Allowed
	// Now is the Redis time of the decision (of Admit's subject layer, of
	// Check's first group of counters), which dates a later give-back of
	// what it charged (Adjust's at); this host's time when Redis did not
	// decide that part (decided locally; a Check without countable charges).
	Now time.Time
}

// LimitState is one limit after a decision, as the API and events show it.
// For a limit served from leases, Limit is exact and Remaining best effort:
// Redis's remaining at the last lease plus what this instance still holds.
// For a limit decided locally, Remaining is what this instance may still
// allow and Used the usage it knows of (see local.go): never more than
// really happened, so a subject it never saw does not look nearly full.
type LimitState struct {
	Scope     policy.Scope
	Name      string
	Endpoint  string // set for endpoint limits
	Unit      policy.Unit
	Limit     int64
	Used      int64
	Remaining int64
	Reset     time.Duration
	WouldDeny bool // shadow limit that would have denied
	Shadow    bool
}
