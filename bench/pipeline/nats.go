package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// natsCounts are a nats-server's message counters: what the server
// handles per accounted request, beside its CPU.
type natsCounts struct {
	In     int64 `json:"in_msgs"`  // from clients: publishes, acks, pull and API requests
	Out    int64 `json:"out_msgs"` // to clients: deliveries, publish acks, replies
	Stored int64 `json:"-"`        // messages its streams hold (/jsz)
}

func (c natsCounts) sub(o natsCounts) natsCounts {
	return natsCounts{In: c.In - o.In, Out: c.Out - o.Out, Stored: c.Stored - o.Stored}
}

// readNATS reads the counters from the server's monitoring endpoint.
func readNATS(ctx context.Context, monitor string) (natsCounts, error) {
	var c natsCounts
	if err := getJSON(ctx, monitor+"/varz", &c); err != nil {
		return c, err
	}
	var jsz struct {
		Messages int64 `json:"messages"`
	}
	if err := getJSON(ctx, monitor+"/jsz", &jsz); err != nil {
		return c, err
	}
	c.Stored = jsz.Messages
	return c, nil
}

func getJSON(ctx context.Context, url string, v any) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}
