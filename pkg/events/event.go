package events

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"quotaflow/pkg/ident"
)

// CloudEvent type strings, one per kind of event.
const (
	TypeReserved  = "quotaflow.usage.reserved"
	TypeDenied    = "quotaflow.usage.denied"
	TypeActual    = "quotaflow.usage.actual"
	TypeReleased  = "quotaflow.usage.released"
	TypeCorrected = "quotaflow.usage.corrected"
	TypeTopUp     = "quotaflow.balance.topup"
)

// Envelope constants.
const (
	// SpecVersion is the CloudEvents version of every event.
	SpecVersion = "1.0"
	// DataContentType is the datacontenttype of every event.
	DataContentType = "application/json"
	// ContentType is the Content-Type header of a published event: the
	// CloudEvents NATS binding's structured mode.
	ContentType = "application/cloudevents+json"
)

// Limits of a valid event. Decode rejects anything beyond them and Encode
// refuses to produce it.
const (
	// MaxEventSize is the largest encoded event, in bytes. Real events are
	// well under 4 KiB; the cap keeps a hostile producer from making
	// consumers parse megabytes.
	MaxEventSize = 64 << 10
	// MaxID is the longest identifier (tenant, user, request id, endpoint,
	// model, plan, limit name, reference, event id, source), in bytes:
	// ident.MaxLen, the bound every boundary applies.
	MaxID = ident.MaxLen
	// MaxCount is the largest token count, amount or limit, and the largest
	// magnitude of a delta: Redis keeps counters as 48-bit integers, and
	// 1e12 stays below 2^48 with room to add.
	MaxCount = 1_000_000_000_000
	// MaxVersion is the largest version: the largest integer every JSON
	// reader keeps exact (2^53-1). Versions grow with Redis time in
	// microseconds (about 1.8e15 in 2026), so they outgrow MaxCount.
	MaxVersion = 1<<53 - 1
)

// Event is one quotaflow CloudEvent: the envelope of the CloudEvents 1.0
// structured JSON format and one of the Data types (Reserved, Denied,
// Actual, Released, Corrected, TopUp).
//
// The type, subject, specversion and datacontenttype attributes follow from
// Data, so an Event cannot carry a type that disagrees with its data. Build
// one with NewReserved and its siblings, which derive the deterministic ID;
// read one with Decode. Consumers switch on Data:
//
//	switch d := ev.Data.(type) {
//	case events.Actual:
//		...
//	}
//
// An Event is a value; it holds no references but Data's slices.
type Event struct {
	// ID is the CloudEvent id and the JetStream Nats-Msg-Id: printable
	// ASCII, at most MaxID bytes. Producers derive it with ID, TopUpID or
	// DeniedID so that a retried publish is dropped as a duplicate.
	ID string
	// Source names the producer, e.g. "quotaflow/admission".
	Source string
	// Time is when the event happened. Decode returns it in UTC.
	Time time.Time
	// Data is the payload: a Reserved, Denied, Actual, Released, Corrected
	// or TopUp value (never a pointer).
	Data Data
}

// Data is the payload of an Event: one of Reserved, Denied, Actual,
// Released, Corrected and TopUp. The interface is closed; other types
// cannot implement it.
type Data interface {
	// Type returns the CloudEvent type string, e.g. TypeActual.
	Type() string
	tenantUser() (tenant, user string)
	validate(c checker)
}

// Type returns the CloudEvent type of the event's Data, or "" when Data is
// nil.
func (e Event) Type() string {
	if e.Data == nil {
		return ""
	}
	return e.Data.Type()
}

// Subject returns the CloudEvent subject "<tenant>/<user>". It is
// informational: tenant may contain '/', so consumers read tenant and user
// from Data.
func (e Event) Subject() string {
	if e.Data == nil {
		return ""
	}
	t, u := e.Data.tenantUser()
	return t + "/" + u
}

// LimitState is one limit after a decision or correction, as in the
// admission API's admit response. Counts are in Unit; Used and Remaining
// are after the decision.
type LimitState struct {
	// Scope is whose counter it is: "ip", "global", "tenant" or "user".
	Scope string `json:"scope"`
	// Name is the limit's name in the policy, unique within its scope.
	Name string `json:"name"`
	// Endpoint is set for endpoint limits (global and per-user lists of an
	// endpoint), empty otherwise.
	Endpoint string `json:"endpoint,omitempty"`
	// Unit is "tokens" or "requests".
	Unit string `json:"unit"`
	// Limit is the limit; for a balance, the credits topped up so far.
	Limit int64 `json:"limit"`
	// Used is the amount counted in the window.
	Used int64 `json:"used"`
	// Remaining is what still fits. It is negative only when a correction
	// pushed Used past Limit.
	Remaining int64 `json:"remaining"`
	// ResetSeconds is when the window frees capacity or resets, in whole
	// seconds; 0 when nothing is used or it never resets.
	ResetSeconds int64 `json:"reset_seconds"`
}

// LimitRef names a limit: a shadow limit that would have denied.
type LimitRef struct {
	// Scope is "ip", "global", "tenant" or "user".
	Scope string `json:"scope"`
	// Name is the limit's name in the policy.
	Name string `json:"name"`
	// Endpoint is set for endpoint limits.
	Endpoint string `json:"endpoint,omitempty"`
}

// Reserved is published by admission when it admits a request and reserves
// its estimated cost. Its ID derives from (type, tenant, user, request id),
// so admitting the same request again publishes a duplicate that JetStream
// drops.
type Reserved struct {
	RequestID string `json:"request_id"` // the admitted request
	Tenant    string `json:"tenant"`     // the tenant, as given to admission
	User      string `json:"user"`       // the user within the tenant
	// Plan is the plan the decision used; empty when no plan applied.
	Plan     string `json:"plan,omitempty"`
	Endpoint string `json:"endpoint"`        // the endpoint as admission saw it
	Model    string `json:"model,omitempty"` // empty when not given
	// IP is the client address (IPv4 or IPv6), empty when unknown.
	IP string `json:"ip,omitempty"`
	// EstimatedTokens is the reserved cost in weighted tokens.
	EstimatedTokens int64 `json:"estimated_tokens"`
	// ExpiresAt is when an unsettled reservation lapses.
	ExpiresAt time.Time `json:"expires_at"`
	// Version is the subject's version after this reservation; it orders
	// the snapshots in Limits (drop one older than the last seen). 0 when
	// admission decided without Redis: no Redis window holds the estimate,
	// so the accounter charges the actual in full, and Limits is that
	// instance's local view rather than usage, so the alerter takes no
	// thresholds from it.
	Version int64 `json:"version"`
	// TenantVersion is the tenant's version, which orders snapshots of
	// tenant-scope limits across the tenant's users; 0 when not known.
	TenantVersion int64 `json:"tenant_version,omitempty"`
	// Limits is every limit that applied, after the decision.
	Limits []LimitState `json:"limits,omitempty"`
	// WouldDeny lists the shadow limits that would have denied.
	WouldDeny []LimitRef `json:"would_deny,omitempty"`
}

// Denied is published by admission for denials, aggregated per second and
// per (tenant, user, ip, endpoint, scope, name): Count denials happened in
// the second that starts at the event's Time. Each admission instance
// publishes its own aggregate (see DeniedID): consumers add the counts.
type Denied struct {
	Tenant   string `json:"tenant"`       // the tenant, as given to admission
	User     string `json:"user"`         // the user within the tenant
	IP       string `json:"ip,omitempty"` // client address, empty when unknown
	Endpoint string `json:"endpoint"`     // the endpoint of the denied requests
	Scope    string `json:"scope"`        // scope of the limit that denied
	Name     string `json:"name"`         // name of the limit that denied
	// Count is the number of denials in the second, at least 1.
	Count int64 `json:"count"`
}

// Actual is published by services (or by admission for POST /v1/usage)
// after a request, with the tokens it really used. Costs are raw tokens;
// the accounter applies the model's weights.
type Actual struct {
	RequestID    string `json:"request_id"`         // the request_id admission reserved for
	Tenant       string `json:"tenant"`             // the tenant, as given to admission
	User         string `json:"user"`               // the user within the tenant
	Endpoint     string `json:"endpoint,omitempty"` // empty when not known
	Model        string `json:"model,omitempty"`    // selects the cost weights; empty = weight 1
	InputTokens  int64  `json:"input_tokens"`       // raw, unweighted
	OutputTokens int64  `json:"output_tokens"`      // raw, unweighted
}

// Released says a request failed before using tokens: its estimate and
// concurrency slots come back. Actual usage always wins: an actual of the
// same request, before or after, is charged in full.
type Released struct {
	RequestID string `json:"request_id"` // the reservation to give back
	Tenant    string `json:"tenant"`     // the tenant, as given to admission
	User      string `json:"user"`       // the user within the tenant
	// Status says what admission's release did in Redis: ReleaseReleased
	// (the estimate given back now), ReleaseAlreadySettled (settled before:
	// nothing changed), ReleaseUnknown (no reservation of the id: nothing
	// changed) or ReleaseQueued (Redis unreachable: the consumer gives it
	// back). Empty from other publishers: like queued.
	Status string `json:"status,omitempty"`
	// ReturnedTokens is the estimate given back (status released).
	ReturnedTokens int64 `json:"returned_tokens,omitempty"`
}

// Statuses of a Released event from admission.
const (
	ReleaseReleased       = "released"
	ReleaseAlreadySettled = "already_settled"
	ReleaseUnknown        = "unknown"
	ReleaseQueued         = "queued"
)

// Corrected is published by the accounter after it moved a reservation's
// token windows by Delta = actual - estimate (weighted tokens; negative
// gives tokens back).
type Corrected struct {
	RequestID string `json:"request_id"` // the corrected reservation
	Tenant    string `json:"tenant"`     // the tenant, as given to admission
	User      string `json:"user"`       // the user within the tenant
	// Plan is the plan the reservation's decision used (its reserved
	// event's); empty when no plan applied, and from accounters older
	// than the field.
	Plan  string `json:"plan,omitempty"`
	Delta int64  `json:"delta"` // weighted tokens added (negative: given back)
	// Version is the subject's version after the correction.
	Version int64 `json:"version"`
	// TenantVersion is the tenant's version; 0 when not known.
	TenantVersion int64 `json:"tenant_version,omitempty"`
	// Limits holds the touched limits after the correction.
	Limits []LimitState `json:"limits,omitempty"`
}

// TopUp is published by admission when prepaid credits were added to a
// balance. Its ID derives from (tenant, reference), the top-up's
// idempotency key.
type TopUp struct {
	Tenant string `json:"tenant"` // owner of the balance
	// User is empty for a tenant-wide balance.
	User string `json:"user,omitempty"`
	// Amount is the credits added, at least 1.
	Amount int64 `json:"amount"`
	// Reference is the caller's unique reference (payment id, order id).
	Reference string `json:"reference"`
}

// Type implements Data.
func (Reserved) Type() string { return TypeReserved }

// Type implements Data.
func (Denied) Type() string { return TypeDenied }

// Type implements Data.
func (Actual) Type() string { return TypeActual }

// Type implements Data.
func (Released) Type() string { return TypeReleased }

// Type implements Data.
func (Corrected) Type() string { return TypeCorrected }

// Type implements Data.
func (TopUp) Type() string { return TypeTopUp }

func (d Reserved) tenantUser() (string, string)  { return d.Tenant, d.User }
func (d Denied) tenantUser() (string, string)    { return d.Tenant, d.User }
func (d Actual) tenantUser() (string, string)    { return d.Tenant, d.User }
func (d Released) tenantUser() (string, string)  { return d.Tenant, d.User }
func (d Corrected) tenantUser() (string, string) { return d.Tenant, d.User }
func (d TopUp) tenantUser() (string, string)     { return d.Tenant, d.User }

// NewReserved returns the event for d from source at now, with its
// deterministic ID.
func NewReserved(source string, d Reserved, now time.Time) Event {
	return Event{ID: ID(TypeReserved, d.Tenant, d.User, d.RequestID), Source: source, Time: now.UTC(), Data: d}
}

// NewDenied returns the event for d, the denials origin counted in the
// second that holds now: its Time is the start of that second and its ID
// derives from the second and origin (see DeniedID), so one aggregate per
// origin, second and key is stored however often it is published.
func NewDenied(source string, d Denied, now time.Time, origin string) Event {
	sec := time.Unix(now.Unix(), 0).UTC()
	return Event{ID: DeniedID(d, sec, origin), Source: source, Time: sec, Data: d}
}

// NewActual returns the event for d from source at now, with its
// deterministic ID.
func NewActual(source string, d Actual, now time.Time) Event {
	return Event{ID: ID(TypeActual, d.Tenant, d.User, d.RequestID), Source: source, Time: now.UTC(), Data: d}
}

// NewReleased returns the event for d from source at now, with its
// deterministic ID.
func NewReleased(source string, d Released, now time.Time) Event {
	return Event{ID: ID(TypeReleased, d.Tenant, d.User, d.RequestID), Source: source, Time: now.UTC(), Data: d}
}

// NewCorrected returns the event for d from source at now, with its
// deterministic ID.
func NewCorrected(source string, d Corrected, now time.Time) Event {
	return Event{ID: ID(TypeCorrected, d.Tenant, d.User, d.RequestID), Source: source, Time: now.UTC(), Data: d}
}

// NewTopUp returns the event for d from source at now, with the ID derived
// from (tenant, reference).
func NewTopUp(source string, d TopUp, now time.Time) Event {
	return Event{ID: TopUpID(d.Tenant, d.Reference), Source: source, Time: now.UTC(), Data: d}
}

// envelope is the wire form of an Event.
type envelope struct {
	SpecVersion     string    `json:"specversion"`
	ID              string    `json:"id"`
	Source          string    `json:"source"`
	Type            string    `json:"type"`
	Time            time.Time `json:"time"`
	Subject         string    `json:"subject"`
	DataContentType string    `json:"datacontenttype"`
	Data            Data      `json:"data"`
}

// MarshalJSON encodes the event as a CloudEvents structured JSON envelope
// without validating it; Encode validates.
func (e Event) MarshalJSON() ([]byte, error) {
	if e.Data == nil {
		return nil, fmt.Errorf("%w: data: required", ErrInvalid)
	}
	if b, ok := appendFast(make([]byte, 0, 1024), &e); ok {
		return b, nil
	}
	return e.marshalSlow()
}

// marshalSlow is MarshalJSON through encoding/json, for every event.
func (e Event) marshalSlow() ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	// Identifiers are arbitrary text; HTML escaping would only inflate it.
	enc.SetEscapeHTML(false)
	err := enc.Encode(envelope{
		SpecVersion:     SpecVersion,
		ID:              e.ID,
		Source:          e.Source,
		Type:            e.Data.Type(),
		Time:            e.Time,
		Subject:         e.Subject(),
		DataContentType: DataContentType,
		Data:            e.Data,
	})
	if err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// UnmarshalJSON decodes and validates an event with Decode, so that
// json.Unmarshal of a []Event (the body of POST /v1/usage) checks every
// element.
func (e *Event) UnmarshalJSON(b []byte) error {
	ev, err := Decode(b)
	if err != nil {
		return err
	}
	*e = ev
	return nil
}

// Encode validates ev and returns its JSON, the exact bytes a Publisher
// sends. Its errors wrap ErrInvalid.
func Encode(ev Event) ([]byte, error) {
	return AppendEncode(make([]byte, 0, 1024), ev) // a reserved event with a few limits fits
}

// AppendEncode appends Encode(ev) to dst, so that a caller encoding many
// events reuses one buffer (stream.Publisher packs a batch so); on an error
// dst is returned as it was.
func AppendEncode(dst []byte, ev Event) ([]byte, error) {
	if err := ev.Validate(); err != nil {
		return dst, err
	}
	n := len(dst)
	b, ok := appendFast(dst, &ev)
	if !ok {
		s, err := ev.marshalSlow()
		if err != nil {
			return dst, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		b = append(b[:n], s...)
	}
	if len(b)-n > MaxEventSize {
		return dst, fmt.Errorf("%w: event: %d bytes, larger than %d", ErrInvalid, len(b)-n, MaxEventSize)
	}
	return b, nil
}
