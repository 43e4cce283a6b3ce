package events

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of Config. A zero field means its default.
const (
	DefaultStream        = "QUOTAFLOW_USAGE"
	DefaultSubjectPrefix = "quotaflow"
	DefaultDLQStream     = "QUOTAFLOW_DLQ"
	// DefaultMaxAge keeps events for a day, so a consumer may be down that
	// long without losing any. Reservations in Redis must live at least as
	// long (limits.Options.ReservationTTL).
	DefaultMaxAge = 24 * time.Hour
	// DefaultDuplicates is the dedup window: it must cover the longest time
	// a publisher keeps retrying one event. The server holds every id of
	// the window in memory (about 100 bytes each), so size it as
	// events per second times window.
	DefaultDuplicates = 2 * time.Hour
	// DefaultDLQMaxAge keeps dead letters for 30 days, time to fix and
	// replay them.
	DefaultDLQMaxAge = 30 * 24 * time.Hour
	DefaultReplicas  = 1
	// DefaultMaxDeliver lets a failing event be tried 20 times; with the
	// backoff of Process (1 s doubling up to AckWait) that is about 8
	// minutes of a dependency's outage before it is dead-lettered.
	DefaultMaxDeliver = 20
	DefaultAckWait    = 30 * time.Second
)

// Config names the streams and sets their limits. The zero value means the
// defaults, which production uses; tests and benchmarks set their own
// Stream, DLQStream and SubjectPrefix, since two streams may not share
// subjects on one server. The envconfig tags let a service embed it in its
// own configuration (prefix QF).
type Config struct {
	// Stream is the usage stream, on "<SubjectPrefix>.usage.>".
	Stream string `envconfig:"STREAM" default:"QUOTAFLOW_USAGE"`
	// SubjectPrefix is the first subject token(s), e.g. "quotaflow".
	SubjectPrefix string `envconfig:"SUBJECT_PREFIX" default:"quotaflow"`
	// DLQStream retains dead letters, on "<SubjectPrefix>.dlq.>".
	DLQStream string `envconfig:"DLQ_STREAM" default:"QUOTAFLOW_DLQ"`
	// MaxAge is how long the usage stream keeps an event.
	MaxAge time.Duration `envconfig:"STREAM_MAX_AGE" default:"24h"`
	// Duplicates is the dedup window of both streams, at most MaxAge.
	Duplicates time.Duration `envconfig:"STREAM_DUPLICATES" default:"2h"`
	// DLQMaxAge is how long the dead-letter stream keeps a message.
	DLQMaxAge time.Duration `envconfig:"DLQ_MAX_AGE" default:"720h"`
	// Replicas is the replica count of both streams (1 to 5).
	Replicas int `envconfig:"STREAM_REPLICAS" default:"1"`
	// MaxDeliver is how many times a consumer gets an event before Process
	// dead-letters it. Process enforces it rather than the server, so an
	// event whose last attempt was cut short by a crash is still
	// dead-lettered instead of stranded.
	MaxDeliver int `envconfig:"MAX_DELIVER" default:"20"`
	// AckWait is how long the server waits for an ack before redelivering.
	AckWait time.Duration `envconfig:"ACK_WAIT" default:"30s"`
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	set := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	setD := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	set(&c.Stream, DefaultStream)
	set(&c.SubjectPrefix, DefaultSubjectPrefix)
	set(&c.DLQStream, DefaultDLQStream)
	setD(&c.MaxAge, DefaultMaxAge)
	setD(&c.Duplicates, DefaultDuplicates)
	setD(&c.DLQMaxAge, DefaultDLQMaxAge)
	setD(&c.AckWait, DefaultAckWait)
	if c.Replicas == 0 {
		c.Replicas = DefaultReplicas
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = DefaultMaxDeliver
	}
	return c
}

// Validate checks c (zero fields taking their defaults): valid names, a
// dedup window within both streams' max age, positive durations.
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	for _, s := range []struct{ field, v string }{{"stream", c.Stream}, {"dlq_stream", c.DLQStream}} {
		if strings.ContainsAny(s.v, " \t\r\n.*>/\\") || len(s.v) > 255 {
			bad("%s %q: a stream name has at most 255 characters and none of space . * > / \\", s.field, s.v)
		}
	}
	if c.Stream == c.DLQStream {
		bad("stream and dlq_stream are both %q", c.Stream)
	}
	if !validSubject(c.SubjectPrefix) {
		bad("subject_prefix %q: want dot-separated tokens without spaces or wildcards", c.SubjectPrefix)
	}
	if c.MaxAge < 0 || c.DLQMaxAge < 0 || c.AckWait < 0 || c.Duplicates < 0 {
		bad("durations must be positive")
	}
	if c.Duplicates > c.MaxAge {
		bad("stream_duplicates %v is longer than stream_max_age %v", c.Duplicates, c.MaxAge)
	}
	if c.Duplicates > c.DLQMaxAge {
		bad("stream_duplicates %v is longer than dlq_max_age %v", c.Duplicates, c.DLQMaxAge)
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		bad("stream_replicas %d: want 1 to 5", c.Replicas)
	}
	if c.MaxDeliver < 1 {
		bad("max_deliver %d: want at least 1", c.MaxDeliver)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("events config: %w", err)
	}
	return nil
}

func validSubject(s string) bool {
	if s == "" || strings.ContainsAny(s, " \t\r\n*>") {
		return false
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" {
			return false
		}
	}
	return true
}

// subjectSuffix maps a type to the last token of its subject.
func subjectSuffix(typ string) string {
	switch typ {
	case TypeReserved:
		return "reserved"
	case TypeDenied:
		return "denied"
	case TypeActual:
		return "actual"
	case TypeReleased:
		return "released"
	case TypeCorrected:
		return "corrected"
	case TypeTopUp:
		return "topup"
	}
	return ""
}

// Subject returns the NATS subject of events of type typ under prefix, e.g.
// "quotaflow.usage.actual"; top-ups travel on "<prefix>.usage.topup" so
// that one stream and one consumer filter cover every event. It returns ""
// for an unknown type.
func Subject(prefix, typ string) string {
	s := subjectSuffix(typ)
	if s == "" {
		return ""
	}
	return prefix + ".usage." + s
}

// UsageSubjects returns the filter of every usage event under prefix,
// "<prefix>.usage.>".
func UsageSubjects(prefix string) string { return prefix + ".usage.>" }

// DLQSubject returns "<prefix>.dlq.<reason>". Characters of reason other
// than A-Z a-z 0-9 _ - become '_', so any reason is one valid token; an
// empty one becomes "unknown".
func DLQSubject(prefix, reason string) string {
	if reason == "" {
		reason = "unknown"
	}
	b := []byte(reason)
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' || ch == '_' || ch == '-') {
			b[i] = '_'
		}
	}
	return prefix + ".dlq." + string(b)
}

// EnsureStreams creates or updates the usage stream and the dead-letter
// stream to match cfg; calling it again with the same cfg changes nothing.
// Services call it before reporting ready. It uses only features of
// nats-server 2.9 (file storage, limits retention, a duplicate window).
func EnsureStreams(ctx context.Context, js jetstream.StreamManager, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.withDefaults()
	streams := []jetstream.StreamConfig{{
		Name:        cfg.Stream,
		Description: "quotaflow usage events (CloudEvents JSON)",
		Subjects:    []string{UsageSubjects(cfg.SubjectPrefix)},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		Discard:     jetstream.DiscardOld,
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.Duplicates,
		Replicas:    cfg.Replicas,
		// Room for the headers beside the largest valid event.
		MaxMsgSize: MaxEventSize + 4<<10,
	}, {
		Name:        cfg.DLQStream,
		Description: "quotaflow dead letters: events consumers could not process",
		Subjects:    []string{cfg.SubjectPrefix + ".dlq.>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		Discard:     jetstream.DiscardOld,
		MaxAge:      cfg.DLQMaxAge,
		Duplicates:  cfg.Duplicates,
		Replicas:    cfg.Replicas,
	}}
	for _, sc := range streams {
		if _, err := js.CreateOrUpdateStream(ctx, sc); err != nil {
			return fmt.Errorf("ensure stream %s: %w", sc.Name, err)
		}
	}
	return nil
}
