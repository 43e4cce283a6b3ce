package stream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// Config names the streams and sets their limits. Each field's default
// tag is its default, for envconfig (a service embeds Config in its own
// configuration, prefix QF) and for a zero field: the zero Config means
// the defaults, which production uses. Tests and benchmarks set their own
// Stream, DLQStream and SubjectPrefix, since two streams may not share
// subjects on one server.
type Config struct {
	// Stream is the usage stream, on events.UsageSubjects(SubjectPrefix).
	Stream string `envconfig:"STREAM" default:"QUOTAFLOW_USAGE"`
	// SubjectPrefix is the first subject token(s) of every subject
	// (events.Subject).
	SubjectPrefix string `envconfig:"SUBJECT_PREFIX" default:"quotaflow"`
	// DLQStream retains dead letters, on events.DLQSubjects(SubjectPrefix).
	DLQStream string `envconfig:"DLQ_STREAM" default:"QUOTAFLOW_DLQ"`
	// MaxAge is how long the usage stream keeps an event: a day, so a
	// consumer may be down that long without losing any. Reservations in
	// Redis must live at least as long (limits.Options.ReservationTTL).
	MaxAge time.Duration `envconfig:"STREAM_MAX_AGE" default:"24h"`
	// Duplicates is the dedup window of both streams, at most MaxAge. It
	// must cover the longest time a publisher keeps retrying one event; the
	// server holds every id of the window in memory (about 100 bytes
	// each), so size it as events per second times window.
	Duplicates time.Duration `envconfig:"STREAM_DUPLICATES" default:"2h"`
	// DLQMaxAge is how long the dead-letter stream keeps a message: 30
	// days, time to fix and replay it.
	DLQMaxAge time.Duration `envconfig:"DLQ_MAX_AGE" default:"720h"`
	// Replicas is the replica count of both streams (1 to 5).
	Replicas int `envconfig:"STREAM_REPLICAS" default:"1"`
	// MaxDeliver is how many times a consumer gets an event before Process
	// dead-letters it: with Process's backoff (1 s doubling up to AckWait),
	// 20 tries are about 8 minutes of a dependency's outage. Process
	// enforces it rather than the server, so an event whose last attempt
	// was cut short by a crash is still dead-lettered instead of stranded.
	MaxDeliver int `envconfig:"MAX_DELIVER" default:"20"`
	// AckWait is how long the server waits for an ack before redelivering.
	AckWait time.Duration `envconfig:"ACK_WAIT" default:"30s"`
	// Compression is how a Publisher sends batch messages: EncodingS2, or
	// CompressionNone while a consumer of the stream predates compression
	// (it dead-letters a compressed batch whole), e.g. after rolling the
	// accounter or the alerter back.
	Compression string `envconfig:"EVENT_COMPRESSION" default:"s2"`
}

// CompressionNone is the Config.Compression of batches sent as plain JSON.
const CompressionNone = "none"

// defaults is the Config of the fields' default tags, which envconfig also
// applies to a service's configuration: the tags are the one place each
// default is written.
var defaults = func() Config {
	var c Config
	v := reflect.ValueOf(&c).Elem()
	for i := range v.NumField() {
		f, tag := v.Type().Field(i), v.Type().Field(i).Tag.Get("default")
		var err error
		switch p := v.Field(i).Addr().Interface().(type) {
		case *string:
			*p = tag
		case *int:
			*p, err = strconv.Atoi(tag)
		case *time.Duration:
			*p, err = time.ParseDuration(tag)
		default:
			err = fmt.Errorf("unsupported type %s", f.Type)
		}
		if err != nil {
			panic(fmt.Sprintf("stream.Config.%s: default %q: %v", f.Name, tag, err))
		}
	}
	return c
}()

// Defaults returns the default of every setting: what a service reads
// from an empty environment, and what a zero field of a Config means.
func Defaults() Config { return defaults }

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	d := defaults
	c.Stream = cmp.Or(c.Stream, d.Stream)
	c.SubjectPrefix = cmp.Or(c.SubjectPrefix, d.SubjectPrefix)
	c.DLQStream = cmp.Or(c.DLQStream, d.DLQStream)
	c.MaxAge = cmp.Or(c.MaxAge, d.MaxAge)
	c.Duplicates = cmp.Or(c.Duplicates, d.Duplicates)
	c.DLQMaxAge = cmp.Or(c.DLQMaxAge, d.DLQMaxAge)
	c.Replicas = cmp.Or(c.Replicas, d.Replicas)
	c.MaxDeliver = cmp.Or(c.MaxDeliver, d.MaxDeliver)
	c.AckWait = cmp.Or(c.AckWait, d.AckWait)
	c.Compression = cmp.Or(c.Compression, d.Compression)
	return c
}

// Validate checks c (zero fields taking their defaults): valid names, a
// dedup window within both streams' max age, positive durations, a known
// compression. Each error names the setting's variable (Env).
func (c Config) Validate() error {
	c = c.WithDefaults()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	for _, s := range []struct{ field, v string }{{"Stream", c.Stream}, {"DLQStream", c.DLQStream}} {
		if strings.ContainsAny(s.v, " \t\r\n.*>/\\") || len(s.v) > 255 {
			bad("%s %q: a stream name has at most 255 characters and none of space . * > / \\", Env(s.field), s.v)
		}
	}
	if c.Stream == c.DLQStream {
		bad("%s and %s are both %q", Env("Stream"), Env("DLQStream"), c.Stream)
	}
	if !validSubject(c.SubjectPrefix) {
		bad("%s %q: want dot-separated tokens without spaces or wildcards", Env("SubjectPrefix"), c.SubjectPrefix)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{{"MaxAge", c.MaxAge}, {"Duplicates", c.Duplicates}, {"DLQMaxAge", c.DLQMaxAge}, {"AckWait", c.AckWait}} {
		if d.v < 0 {
			bad("%s %v: want a positive duration", Env(d.field), d.v)
		}
	}
	if c.Duplicates > c.MaxAge {
		bad("%s %v is longer than %s %v", Env("Duplicates"), c.Duplicates, Env("MaxAge"), c.MaxAge)
	}
	if c.Duplicates > c.DLQMaxAge {
		bad("%s %v is longer than %s %v", Env("Duplicates"), c.Duplicates, Env("DLQMaxAge"), c.DLQMaxAge)
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		bad("%s %d: want 1 to 5", Env("Replicas"), c.Replicas)
	}
	if c.MaxDeliver < 1 {
		bad("%s %d: want at least 1", Env("MaxDeliver"), c.MaxDeliver)
	}
	if c.Compression != EncodingS2 && c.Compression != CompressionNone {
		bad("%s %q: want %s or %s", Env("Compression"), c.Compression, EncodingS2, CompressionNone)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("stream config: %w", err)
	}
	return nil
}

// envPrefix is the prefix of the variables services read Config from
// (envconfig.Process("QF", ...)).
const envPrefix = "QF_"

// Env is the variable that sets Config's field (its name in Go, e.g.
// "Replicas"): QF_ and the field's envconfig tag, the one place its
// name is written, as QF_STREAM_REPLICAS. It panics on a field Config does
// not have.
func Env(field string) string {
	f, ok := reflect.TypeFor[Config]().FieldByName(field)
	if !ok || f.Tag.Get("envconfig") == "" {
		panic("stream.Env: Config has no setting " + field)
	}
	return envPrefix + f.Tag.Get("envconfig")
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

// Ensure creates or updates the usage stream and the dead-letter stream to
// match cfg; calling it again with the same cfg changes nothing.
// Services call it before reporting ready. It uses only features of
// nats-server 2.9 (file storage, limits retention, a duplicate window).
func Ensure(ctx context.Context, js jetstream.StreamManager, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	streams := []jetstream.StreamConfig{{
		Name:        cfg.Stream,
		Description: "quotaflow usage events (CloudEvents JSON)",
		Subjects:    []string{events.UsageSubjects(cfg.SubjectPrefix)},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		Discard:     jetstream.DiscardOld,
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.Duplicates,
		Replicas:    cfg.Replicas,
		// Room for the headers beside the largest valid batch.
		MaxMsgSize: events.MaxBatchSize + headerRoom,
	}, {
		Name:        cfg.DLQStream,
		Description: "quotaflow dead letters: events consumers could not process",
		Subjects:    []string{events.DLQSubjects(cfg.SubjectPrefix)},
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
