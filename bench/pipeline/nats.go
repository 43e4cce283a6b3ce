package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"
)

// natsCounts are a nats-server's message and byte counters: what the
// server handles per accounted request, beside its CPU (whose cost goes
// by messages rather than bytes at the pipeline's sizes:
// bench/results.md).
type natsCounts struct {
	In          int64 `json:"in_msgs"`   // from clients: publishes, acks, pull and API requests
	Out         int64 `json:"out_msgs"`  // to clients: deliveries, publish acks, replies
	InBytes     int64 `json:"in_bytes"`  // their payloads
	OutBytes    int64 `json:"out_bytes"` // their payloads
	Stored      int64 `json:"-"`         // messages its streams hold (/jsz)
	StoredBytes int64 `json:"-"`         // and their bytes
}

func (c natsCounts) sub(o natsCounts) natsCounts {
	return natsCounts{In: c.In - o.In, Out: c.Out - o.Out, InBytes: c.InBytes - o.InBytes, OutBytes: c.OutBytes - o.OutBytes,
		Stored: c.Stored - o.Stored, StoredBytes: c.StoredBytes - o.StoredBytes}
}

// readNATS reads the counters from the server's monitoring endpoint.
func readNATS(ctx context.Context, monitor string) (natsCounts, error) {
	var c natsCounts
	if err := getJSON(ctx, monitor+"/varz", &c); err != nil {
		return c, err
	}
	var jsz struct {
		Messages int64 `json:"messages"`
		Bytes    int64 `json:"bytes"`
	}
	if err := getJSON(ctx, monitor+"/jsz", &jsz); err != nil {
		return c, err
	}
	c.Stored, c.StoredBytes = jsz.Messages, jsz.Bytes
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

// saveProfile writes to file a CPU profile of d (whole seconds, at least
// one) from a pprof profile endpoint: nats-server's, opened by its
// -profile flag, which also turns on its block profiling, so a profiled
// round's CPU figures run slower than an unprofiled one's.
func saveProfile(ctx context.Context, endpoint string, d time.Duration, file string) error {
	secs := max(1, int(d/time.Second))
	ctx, cancel := context.WithTimeout(ctx, time.Duration(secs)*time.Second+30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"?seconds="+strconv.Itoa(secs), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("nats-server profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("nats-server profile: %s", resp.Status)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("nats-server profile: %w", err)
	}
	return f.Close()
}
