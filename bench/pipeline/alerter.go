package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events/stream"
)

// alerterConsumer is the alerter's durable consumer in the pipeline.
const alerterConsumer = "alerter"

// waitAlerter waits until the alerter's consumers (the durable
// alerterConsumer of an earlier build, or those named from it, one per
// type it reads) have acked every message they are handed, or fails once
// timeout has passed since since, and returns how long after since that
// was: the alerter's catch-up. A round's CPU is read after it, so an
// alerter that falls behind the load is charged for the work it does
// late, as the accounter is.
func waitAlerter(ctx context.Context, url string, since time.Time, timeout time.Duration) (time.Duration, error) {
	js, closeNATS, err := connectJS(url)
	if err != nil {
		return 0, err
	}
	defer closeNATS()
	str, err := js.Stream(ctx, stream.Defaults().Stream)
	if err != nil {
		return 0, err
	}
	for {
		// One request for every consumer's info: asking for the names,
		// then each consumer and its info, took seven.
		pending, acks, n := uint64(0), 0, 0
		list := str.ListConsumers(ctx)
		for info := range list.Info() {
			if name := info.Name; name != alerterConsumer && !strings.HasPrefix(name, alerterConsumer+"-") {
				continue
			}
			pending, acks, n = pending+info.NumPending, acks+info.NumAckPending, n+1
		}
		if err := list.Err(); err != nil {
			return 0, err
		}
		if n > 0 && pending == 0 && acks == 0 {
			return time.Since(since), nil
		}
		if time.Since(since) > timeout {
			return 0, fmt.Errorf("the alerter's %d consumers have %d messages pending and %d unacked after %v", n, pending, acks, timeout)
		}
		time.Sleep(alerterPoll)
	}
}

// alerterPoll is how often waitAlerter asks nats-server for the alerter's
// consumers' info: a consumer's info costs the server ~250 µs of CPU on a
// loaded host, inside the round's measured span, so asking every 5 ms
// through a catch-up of seconds charged nats-server for the bench's own
// work (bench/results.md, "NATS per accounted request (session 8)"). The
// catch-up is measured to this step.
const alerterPoll = 50 * time.Millisecond

// connectJS connects to NATS at url for a JetStream question; the caller
// calls closeNATS when done.
func connectJS(url string) (js jetstream.JetStream, closeNATS func(), err error) {
	nc, err := nats.Connect(url)
	if err != nil {
		return nil, nil, err
	}
	js, err = jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return js, nc.Close, nil
}
