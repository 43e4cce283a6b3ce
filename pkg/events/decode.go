package events

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"unicode/utf8"
)

// ErrInvalid is wrapped by every error of Decode, Encode and
// Event.Validate: the event breaks the contract. Consumers send such events
// to the dead-letter stream (see Process); retrying cannot help.
var ErrInvalid = errors.New("invalid event")

// maxProblems bounds how many problems one error lists, so an error stays
// short enough for a log line and a NATS header.
const maxProblems = 10

// Decode parses and validates one event in the CloudEvents structured JSON
// form. The error, which wraps ErrInvalid, lists what is wrong by JSON path,
// e.g. "invalid event: data.input_tokens: must be >= 0".
//
// Besides the per-field rules written in the package documentation, Decode
// rejects input over MaxEventSize, invalid UTF-8, duplicate keys in the
// envelope or data (JSON parsers disagree on which one wins) and trailing
// data. Keys match exactly: "Tenant" is not "tenant". Unknown keys are
// ignored, so producers may add CloudEvents extension attributes and
// consumers tolerate fields added to data later.
func Decode(b []byte) (Event, error) { return Decoder{}.Decode(b) }

// Decoder decodes events as Decode and DecodeBatch do, reading less of
// them for a consumer that needs less. The zero value reads everything.
type Decoder struct {
	// NoSnapshots leaves the limit snapshot of reserved and corrected
	// events (limits, would_deny) unread and unchecked: Limits and
	// WouldDeny stay nil, and a snapshot that breaks the rules does not
	// make the event invalid. It is for a consumer that reads nothing of
	// the snapshot (the accounter; the alerter reads and checks it): the
	// snapshot is most of a reserved event's decoding. Everything else is
	// checked as Decode checks it, and the whole input must still be
	// valid UTF-8 and JSON.
	NoSnapshots bool
}

// Decode is Decode, reading what d says.
func (d Decoder) Decode(b []byte) (Event, error) { return decode(b, nil, d, false, nil) }

// DecodeReported is Decode for an event whose id its receiver derives
// (admission's POST /v1/usage derives it from the event's type, tenant,
// user and request id, so that no caller can claim another's id): an id
// in b is ignored, whatever it holds, and the returned event has none.
func DecodeReported(b []byte) (Event, error) { return decode(b, nil, Decoder{}, true, nil) }

// decode is d.Decode, or DecodeReported when noID. When sp is not nil, b
// is known to be valid UTF-8 and JSON: a slice of a text checked as a
// whole (a batch), whose containers sp holds. names, when not
// nil, holds the limits' names and endpoints that the earlier events of a
// batch met, to share one copy (reader.name).
func decode(b []byte, sp *spans, d Decoder, noID bool, names map[string]string) (Event, error) {
	if len(b) > MaxEventSize {
		return Event{}, fmt.Errorf("%w: event: %d bytes, larger than %d", ErrInvalid, len(b), MaxEventSize)
	}
	if sp == nil && !utf8.Valid(b) {
		return Event{}, fmt.Errorf("%w: event: not valid UTF-8", ErrInvalid)
	}
	// The members of every object of the event, from one arena (object),
	// sized for about one member per 12 bytes: a reserved event with five
	// limits has 61 members in ~820 bytes, an actual one 16 in ~350.
	n := len(b)/12 + 8
	if d.NoSnapshots {
		// No snapshot's objects: a reserved event has 21 members then.
		n = min(n, 24)
	}
	s := getScratch(n)
	defer putScratch(s)
	if sp == nil {
		if !validate(b, &s.spans) {
			// Only now pay for the parser's description of the mistake.
			err := json.Unmarshal(b, new(json.RawMessage))
			return Event{}, fmt.Errorf("%w: event: not valid JSON: %v", ErrInvalid, err)
		}
		sp = &s.spans
	}
	free := &s.free
	top, err := object(b, sp, free)
	if err != nil {
		return Event{}, fmt.Errorf("%w: event: %v", ErrInvalid, err)
	}
	c := checker{st: &s.check}
	r := &reader{c: c, m: top, free: free, spans: sp, names: names, noSnapshots: d.NoSnapshots}
	spec := r.oneOf("specversion", specVersions)
	ev := Event{Source: r.str("source"), Time: r.time("time").UTC()}
	if !noID {
		ev.ID = r.str("id")
	}
	typ := r.oneOf("type", types)
	subject := r.str("subject")
	contentType := r.oneOf("datacontenttype", contentTypes)

	// Problems are reported in the order of the documentation: envelope,
	// then data field by field.
	c.equal("specversion", spec, SpecVersion)
	if !noID {
		c.eventID("id", ev.ID)
	}
	c.ident("source", ev.Source, true)
	switch {
	case c.pending("type"):
	case typ == "":
		c.add("type", "required")
	case readers[typ] == nil:
		c.add("type", fmt.Sprintf("unknown type %q", short(typ)))
	}
	c.time("time", ev.Time)
	c.equal("datacontenttype", contentType, DataContentType)

	raw, ok := r.raw("data")
	var data []member
	if !ok {
		c.add("data", "required")
	} else if data, err = object(raw, sp, free); err != nil {
		c.add("data", err.Error())
	}
	if err == nil && ok {
		dr := &s.data
		*dr = reader{c: c.at("data."), m: data, free: free, spans: sp, names: names, noSnapshots: d.NoSnapshots}
		if read := readers[typ]; read != nil {
			ev.Data = read(dr)
		}
		if ev.Data != nil {
			ev.Data.validate(c.at("data."))
		}
	}
	if !c.pending("subject") && subject != "" && ev.Data != nil && !isSubject(subject, ev.Data) {
		c.add("subject", "must be data's \"<tenant>/<user>\" or absent")
	}
	if err := c.err(); err != nil {
		return Event{}, err
	}
	return ev, nil
}

// scratch is what one decode works in, recycled through scratches:
// the member arena of its objects, the arena's unused tail, its checker's
// state, the data's reader and the spans of a lone event. Pooled together, none of them is an
// allocation of its own per event. Nothing decode returns points into a
// scratch (its strings are copies), and a new arena per event, sized for
// the worst case, was the largest allocation of admission's POST /v1/usage
// (bench/results.md, "Admission's CPU per call (session 9)").
type scratch struct {
	arena []member
	free  []member // while decoding: the arena's unused room (object)
	check checkState
	data  reader // read through a func value, so it would escape
	spans spans
}

var scratches = sync.Pool{New: func() any { return new(scratch) }}

// maxPooledArena is the most members an arena keeps when it goes back to
// the pool (48 bytes each): a rare huge event's stays out.
const maxPooledArena = 1024

// getScratch returns a clear scratch whose arena has room for n members.
func getScratch(n int) *scratch {
	s := scratches.Get().(*scratch)
	if cap(s.arena) < n {
		s.arena = make([]member, 0, n)
	}
	s.free = s.arena[:0]
	return s
}

// putScratch clears s (its members and reader point into the decoded
// input, which it must not keep alive) and returns it to the pool, unless
// its arena is huge.
func putScratch(s *scratch) {
	if cap(s.arena) > maxPooledArena || cap(s.spans.open) > maxPooledArena {
		return
	}
	clearArena(s.arena, s.free)
	s.free, s.check, s.data = nil, checkState{}, reader{}
	scratches.Put(s)
}

// clearArena clears what a decode used of arena. free is the decode's
// unused tail: while it is arena's, the members before it are the used
// ones (the rest are clear already, so a large arena does not cost each
// small decode a clear of it all); when the members outgrew the arena they
// went to a new array, left to the collector, and the arena is cleared
// whole.
func clearArena(arena, free []member) {
	all := arena[:cap(arena)]
	used := len(all)
	if c := cap(free); c > 0 && c <= len(all) && &free[:c][c-1] == &all[len(all)-1] {
		used -= c
	}
	clear(all[:used])
}

// isSubject reports whether s is d's "<tenant>/<user>", without building it.
func isSubject(s string, d Data) bool {
	t, u := d.tenantUser()
	return len(s) == len(t)+1+len(u) && s[:len(t)] == t && s[len(t)] == '/' && s[len(t)+1:] == u
}

// Validate checks ev against the rules Decode applies, so that what a
// Publisher sends is what consumers accept. The error wraps ErrInvalid.
func (e Event) Validate() error {
	c := newChecker()
	switch e.Data.(type) {
	case Reserved, Denied, Actual, Released, Corrected, TopUp:
	case nil:
		c.add("data", "required")
	default:
		// A pointer to a data type satisfies Data too, but consumers'
		// type switches would miss it.
		c.add("data", fmt.Sprintf("must be a value of a data type, not %T", e.Data))
	}
	c.eventID("id", e.ID)
	c.ident("source", e.Source, true)
	c.time("time", e.Time)
	if e.Data != nil {
		e.Data.validate(c.at("data."))
	}
	return c.err()
}

// readers decode the data of each type.
var readers = map[string]func(*reader) Data{
	TypeReserved:  func(r *reader) Data { var d Reserved; d.read(r); return d },
	TypeDenied:    func(r *reader) Data { var d Denied; d.read(r); return d },
	TypeActual:    func(r *reader) Data { var d Actual; d.read(r); return d },
	TypeReleased:  func(r *reader) Data { var d Released; d.read(r); return d },
	TypeCorrected: func(r *reader) Data { var d Corrected; d.read(r); return d },
	TypeTopUp:     func(r *reader) Data { var d TopUp; d.read(r); return d },
}

// Field rules per type; read (decode) and validate (both directions) list
// the same fields, and the round-trip tests keep them in step with the json
// tags.

func (d *Reserved) read(r *reader) {
	d.RequestID = r.str("request_id")
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.Plan = r.str("plan")
	d.Endpoint = r.str("endpoint")
	d.Model = r.str("model")
	d.IP = r.str("ip")
	d.EstimatedTokens = r.int("estimated_tokens", true)
	d.ExpiresAt = r.time("expires_at").UTC()
	d.Version = r.int("version", true)
	d.TenantVersion = r.int("tenant_version", false)
	d.Limits = readLimits(r, "limits")
	d.WouldDeny = readRefs(r, "would_deny")
}

func (d Reserved) validate(c checker) {
	c.ident("request_id", d.RequestID, true)
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, true)
	c.ident("plan", d.Plan, false)
	c.ident("endpoint", d.Endpoint, true)
	c.ident("model", d.Model, false)
	c.ip("ip", d.IP)
	c.count("estimated_tokens", d.EstimatedTokens, 0)
	c.time("expires_at", d.ExpiresAt)
	c.version("version", d.Version)
	c.version("tenant_version", d.TenantVersion)
	c.limits("limits", d.Limits)
	c.refs("would_deny", d.WouldDeny)
}

func (d *Denied) read(r *reader) {
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.IP = r.str("ip")
	d.Endpoint = r.str("endpoint")
	d.Scope = r.oneOf("scope", scopes)
	d.Name = r.str("name")
	d.Count = r.int("count", true)
}

func (d Denied) validate(c checker) {
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, true)
	c.ip("ip", d.IP)
	c.ident("endpoint", d.Endpoint, true)
	c.scope("scope", d.Scope)
	c.ident("name", d.Name, true)
	c.count("count", d.Count, 1)
}

func (d *Actual) read(r *reader) {
	d.RequestID = r.str("request_id")
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.Endpoint = r.str("endpoint")
	d.Model = r.str("model")
	d.InputTokens = r.int("input_tokens", true)
	d.OutputTokens = r.int("output_tokens", true)
}

func (d Actual) validate(c checker) {
	c.ident("request_id", d.RequestID, true)
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, true)
	c.ident("endpoint", d.Endpoint, false)
	c.ident("model", d.Model, false)
	c.count("input_tokens", d.InputTokens, 0)
	c.count("output_tokens", d.OutputTokens, 0)
}

func (d *Released) read(r *reader) {
	d.RequestID = r.str("request_id")
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.Status = r.str("status")
	d.ReturnedTokens = r.int("returned_tokens", false)
}

func (d Released) validate(c checker) {
	c.ident("request_id", d.RequestID, true)
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, true)
	c.oneOf("status", d.Status, "", ReleaseReleased, ReleaseAlreadySettled, ReleaseUnknown, ReleaseQueued)
	c.count("returned_tokens", d.ReturnedTokens, 0)
}

func (d *Corrected) read(r *reader) {
	d.RequestID = r.str("request_id")
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.Plan = r.str("plan")
	d.Delta = r.int("delta", true)
	d.Version = r.int("version", true)
	d.TenantVersion = r.int("tenant_version", false)
	d.Limits = readLimits(r, "limits")
}

func (d Corrected) validate(c checker) {
	c.ident("request_id", d.RequestID, true)
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, true)
	c.ident("plan", d.Plan, false)
	c.signed("delta", d.Delta)
	c.version("version", d.Version)
	c.version("tenant_version", d.TenantVersion)
	c.limits("limits", d.Limits)
}

func (d *TopUp) read(r *reader) {
	d.Tenant = r.str("tenant")
	d.User = r.str("user")
	d.Amount = r.int("amount", true)
	d.Reference = r.str("reference")
}

func (d TopUp) validate(c checker) {
	c.ident("tenant", d.Tenant, true)
	c.ident("user", d.User, false)
	c.count("amount", d.Amount, 1)
	c.ident("reference", d.Reference, true)
}

// readLimits reads a limit snapshot, unless the reader skips snapshots.
func readLimits(r *reader, name string) []LimitState {
	if r.noSnapshots {
		return nil
	}
	var out []LimitState
	r.array(name, func(n int) { out = make([]LimitState, 0, n) }, func(ir *reader) {
		if ir == nil {
			out = append(out, LimitState{})
			return
		}
		out = append(out, LimitState{
			Scope:        ir.oneOf("scope", scopes),
			Name:         ir.name("name"),
			Endpoint:     ir.name("endpoint"),
			Unit:         ir.oneOf("unit", units),
			Limit:        ir.int("limit", true),
			Used:         ir.int("used", true),
			Remaining:    ir.int("remaining", true),
			ResetSeconds: ir.int("reset_seconds", true),
		})
	})
	return out
}

// readRefs reads a snapshot's limit references, unless the reader skips
// snapshots.
func readRefs(r *reader, name string) []LimitRef {
	if r.noSnapshots {
		return nil
	}
	var out []LimitRef
	r.array(name, func(n int) { out = make([]LimitRef, 0, n) }, func(ir *reader) {
		if ir == nil {
			out = append(out, LimitRef{})
			return
		}
		out = append(out, LimitRef{Scope: ir.oneOf("scope", scopes), Name: ir.name("name"), Endpoint: ir.name("endpoint")})
	})
	return out
}
