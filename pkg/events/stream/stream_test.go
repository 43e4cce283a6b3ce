package stream_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

var testNow = time.Date(2025, 3, 14, 9, 26, 53, 0, time.UTC)

// oneOfEach returns a valid event of each type, in the order of the types.
func oneOfEach() []events.Event {
	return []events.Event{
		events.NewReserved("quotaflow/admission", events.Reserved{
			RequestID: "r-1", Tenant: "acme", User: "u-1", Endpoint: "/v1/chat",
			EstimatedTokens: 100, ExpiresAt: testNow.Add(time.Hour), Version: 1,
		}, testNow),
		events.NewDenied("quotaflow/admission", events.Denied{
			Tenant: "acme", User: "u-1", Endpoint: "/v1/chat", Scope: "user", Name: "5h", Count: 1,
		}, testNow, "test"),
		events.NewActual("svc", events.Actual{RequestID: "r-1", Tenant: "acme", User: "u-1", InputTokens: 80, OutputTokens: 35}, testNow),
		events.NewReleased("svc", events.Released{RequestID: "r-2", Tenant: "acme", User: "u-1"}, testNow),
		events.NewCorrected("quotaflow/accounter", events.Corrected{RequestID: "r-1", Tenant: "acme", User: "u-1", Delta: 15, Version: 2}, testNow),
		events.NewTopUp("quotaflow/admission", events.TopUp{Tenant: "acme", User: "u-1", Amount: 500, Reference: "pay-1"}, testNow),
	}
}

// exampleOf is the event of type typ of oneOfEach.
func exampleOf(t *testing.T, typ string) events.Event {
	t.Helper()
	for _, ev := range oneOfEach() {
		if ev.Type() == typ {
			return ev
		}
	}
	t.Fatalf("no example of %s", typ)
	return events.Event{}
}

// current is ev happening now: consumers refuse an event older than the
// stream keeps them (events.CheckTime).
func current(ev events.Event) events.Event {
	ev.Time = time.Now().UTC()
	return ev
}

// The defaults are the contract's (QF_STREAM and so on), read by a service
// from an empty environment and taken by a zero Config alike.
func TestDefaults(t *testing.T) {
	want := stream.Config{
		Stream: "QUOTAFLOW_USAGE", SubjectPrefix: "quotaflow", DLQStream: "QUOTAFLOW_DLQ",
		MaxAge: 24 * time.Hour, Duplicates: 2 * time.Hour, DLQMaxAge: 30 * 24 * time.Hour,
		Replicas: 1, MaxDeliver: 20, AckWait: 30 * time.Second, Compression: stream.EncodingS2,
	}
	if got := stream.Defaults(); got != want {
		t.Errorf("Defaults() = %+v, want %+v", got, want)
	}
	if got := (stream.Config{}).WithDefaults(); got != want {
		t.Errorf("Config{}.WithDefaults() = %+v, want %+v", got, want)
	}
	var got stream.Config // from QF_STREAMTEST_*, which nothing sets
	if err := envconfig.Process("QF_STREAMTEST", &got); err != nil || got != want {
		t.Errorf("envconfig.Process(empty environment) = %+v, %v; want %+v", got, err, want)
	}
	set := stream.Config{Stream: "S", MaxDeliver: 3}.WithDefaults()
	if set.Stream != "S" || set.MaxDeliver != 3 || set.DLQStream != want.DLQStream {
		t.Errorf("WithDefaults replaced a set field or missed a zero one: %+v", set)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (stream.Config{}).Validate(); err != nil {
		t.Errorf("Config{}.Validate() = %v, want nil (defaults)", err)
	}
	for _, tc := range []struct {
		name string
		cfg  stream.Config
		want string
	}{
		{"stream with dot", stream.Config{Stream: "A.B"}, `QF_STREAM "A.B"`},
		{"dlq stream with slash", stream.Config{DLQStream: "A/B"}, `QF_DLQ_STREAM "A/B"`},
		{"same streams", stream.Config{Stream: "X", DLQStream: "X"}, `QF_STREAM and QF_DLQ_STREAM are both "X"`},
		{"wildcard prefix", stream.Config{SubjectPrefix: "qf.*"}, "QF_SUBJECT_PREFIX"},
		{"empty token", stream.Config{SubjectPrefix: "qf..x"}, "QF_SUBJECT_PREFIX"},
		{"dup window past max age", stream.Config{MaxAge: time.Hour, Duplicates: 2 * time.Hour}, "QF_STREAM_DUPLICATES 2h0m0s is longer than QF_STREAM_MAX_AGE 1h0m0s"},
		{"dup window past dlq age", stream.Config{DLQMaxAge: time.Minute, Duplicates: time.Hour}, "QF_STREAM_DUPLICATES 1h0m0s is longer than QF_DLQ_MAX_AGE 1m0s"},
		{"replicas", stream.Config{Replicas: 7}, "QF_STREAM_REPLICAS 7: want 1 to 5"},
		{"negative max deliver", stream.Config{MaxDeliver: -1}, "QF_MAX_DELIVER -1"},
		{"negative ack wait", stream.Config{AckWait: -time.Second}, "QF_ACK_WAIT -1s: want a positive duration"},
		{"negative max age", stream.Config{MaxAge: -time.Second}, "QF_STREAM_MAX_AGE -1s"},
		{"negative dlq max age", stream.Config{DLQMaxAge: -time.Second}, "QF_DLQ_MAX_AGE -1s"},
		{"negative dup window", stream.Config{Duplicates: -time.Second}, "QF_STREAM_DUPLICATES -1s"},
		{"compression", stream.Config{Compression: "gzip"}, `QF_EVENT_COMPRESSION "gzip": want s2 or none`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate(%+v) = %v, want an error about %s", tc.cfg, err, tc.want)
			}
		})
	}
}

// Env names the variable of each setting, from its envconfig tag, and
// refuses a field that is not one.
func TestEnv(t *testing.T) {
	if got := stream.Env("Replicas"); got != "QF_STREAM_REPLICAS" {
		t.Errorf("Env(Replicas) = %q", got)
	}
	if got := stream.Env("Compression"); got != "QF_EVENT_COMPRESSION" {
		t.Errorf("Env(Compression) = %q", got)
	}
	defer func() {
		if recover() == nil {
			t.Error("Env(NoSuchField) did not panic")
		}
	}()
	stream.Env("NoSuchField")
}

func TestHandlersDispatch(t *testing.T) {
	var got []string
	note := func(s string) { got = append(got, s) }
	h := &stream.Handlers{
		Reserved: func(_ context.Context, _ events.Event, d events.Reserved) error {
			note("reserved " + d.RequestID)
			return nil
		},
		Actual: func(_ context.Context, _ events.Event, d events.Actual) error {
			note("actual " + d.RequestID)
			return nil
		},
		TopUp: func(_ context.Context, _ events.Event, d events.TopUp) error { return errors.New("boom") },
	}
	var errs []error
	for _, ev := range oneOfEach() {
		if err := h.Dispatch(context.Background(), ev); err != nil {
			errs = append(errs, err)
		}
	}
	if want := []string{"reserved r-1", "actual r-1"}; !reflect.DeepEqual(got, want) {
		t.Errorf("handled %v, want %v", got, want)
	}
	if len(errs) != 1 || errs[0].Error() != "boom" {
		t.Errorf("Dispatch errors = %v, want [boom]", errs)
	}
}
