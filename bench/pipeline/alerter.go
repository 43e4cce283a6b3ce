package main

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events/stream"
)

// alerterConsumer is the alerter's durable consumer in the pipeline.
const alerterConsumer = "alerter"

// waitAlerter waits until the alerter's consumer has acked every message
// of the usage stream, or fails once timeout has passed since since, and
// returns how long after since that was: the alerter's catch-up. A round's
// CPU is read after it, so an alerter that falls behind the load is
// charged for the work it does late, as the accounter is.
func waitAlerter(ctx context.Context, url string, since time.Time, timeout time.Duration) (time.Duration, error) {
	js, closeNATS, err := connectJS(url)
	if err != nil {
		return 0, err
	}
	defer closeNATS()
	cons, err := js.Consumer(ctx, stream.Defaults().Stream, alerterConsumer)
	if err != nil {
		return 0, err
	}
	for {
		info, err := cons.Info(ctx)
		if err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
			return time.Since(since), nil
		}
		if time.Since(since) > timeout {
			if err == nil {
				err = fmt.Errorf("the alerter has %d messages pending and %d unacked after %v", info.NumPending, info.NumAckPending, timeout)
			}
			return 0, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

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
