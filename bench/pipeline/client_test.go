package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"quotaflow/bench/internal/load"
	"quotaflow/pkg/events"
)

// fakeAdmission answers admits (every fifth with a 429) and reports (the
// first report of every third request with a 503), and records what it
// saw, to check the client's sequences: what the load generator sends, so
// a fake of admission's HTTP answers, not of a server behind it.
type fakeAdmission struct {
	mu       sync.Mutex
	admitted map[string]string // request id → user, admits answered 200
	reports  map[string]int    // request id → reports answered 202
	tries    map[string]int    // request id → reports received
	tokens   int64             // actual tokens in the reports answered 202
	bad      []string
	n        int
}

func (f *fakeAdmission) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/admit" {
		// Slow admits and quick reports: the load's end nearly always
		// falls while an admit is in flight, whose report must follow.
		time.Sleep(5 * time.Millisecond)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	switch r.URL.Path {
	case "/v1/admit":
		var a struct {
			RequestID       string `json:"request_id"`
			Tenant          string `json:"tenant"`
			User            string `json:"user"`
			Endpoint        string `json:"endpoint"`
			EstimatedTokens int64  `json:"estimated_tokens"`
		}
		if err := json.NewDecoder(r.Body).Decode(&a); err != nil || a.RequestID == "" || a.Tenant != tenant || a.Endpoint != endpoint || a.EstimatedTokens != estimate {
			f.bad = append(f.bad, "admit: "+a.RequestID)
		}
		if _, dup := f.admitted[a.RequestID]; dup {
			f.bad = append(f.bad, "admit again: "+a.RequestID)
		}
		f.n++
		if f.n%5 == 0 {
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		f.admitted[a.RequestID] = a.User
		w.Write([]byte(`{"allowed":true}`))
	case "/v1/usage":
		var evs []json.RawMessage
		if err := json.NewDecoder(r.Body).Decode(&evs); err != nil || len(evs) != 1 {
			f.bad = append(f.bad, "usage: not one event")
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		ev, err := events.DecodeReported(evs[0])
		a, ok := ev.Data.(events.Actual)
		if err != nil || !ok {
			f.bad = append(f.bad, "usage: "+string(evs[0]))
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		if user, ok := f.admitted[a.RequestID]; !ok || user != a.User || a.Tenant != tenant || a.Endpoint != endpoint {
			f.bad = append(f.bad, "usage of a request not admitted as such: "+a.RequestID)
		}
		if a.InputTokens+a.OutputTokens == estimate {
			f.bad = append(f.bad, "actual equals the estimate: "+a.RequestID)
		}
		f.tries[a.RequestID]++
		if len(f.tries)%3 == 0 && f.tries[a.RequestID] == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		f.reports[a.RequestID]++
		f.tokens += a.InputTokens + a.OutputTokens
		w.WriteHeader(http.StatusAccepted)
	}
}

// TestClientSequences checks that every admitted request is reported
// exactly once (a 503 resent, a 429 never reported), also when the load's
// time runs out between an admit and its report, and that the tally
// agrees with what the server saw.
func TestClientSequences(t *testing.T) {
	f := &fakeAdmission{admitted: map[string]string{}, reports: map[string]int{}, tries: map[string]int{}}
	srv := httptest.NewServer(f)
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	const conns = 4
	tallies := make([]*tally, conns)
	_, err := load.Run(context.Background(), load.Config{
		Addr: u.Host, Conns: conns, Duration: 200 * time.Millisecond,
		NewClient: func(conn int) load.Client {
			tallies[conn] = newTally()
			return newClient(u.Host, fmt.Sprintf("t-c%d-", conn), 50, uint64(conn), tallies[conn])
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	total := newTally()
	for _, tl := range tallies {
		total.add(tl)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bad) > 0 {
		t.Errorf("the server saw bad requests: %v", f.bad)
	}
	if len(f.admitted) == 0 {
		t.Fatal("no request admitted")
	}
	for id := range f.admitted {
		if f.reports[id] != 1 {
			t.Errorf("request %s admitted, reported %d times, want 1", id, f.reports[id])
		}
	}
	resent := 0
	for _, n := range f.tries {
		resent += n - 1
	}
	if total.admitted != int64(len(f.admitted)) || total.reported != int64(len(f.reports)) || total.tokens != f.tokens ||
		total.resent != int64(resent) || total.refused[http.StatusTooManyRequests] != int64(f.n-len(f.admitted)) ||
		total.lostAdmit != 0 || len(total.rejected) != 0 {
		t.Errorf("tally %+v; the server admitted %d of %d, took %d reports of %d tokens after %d resends",
			*total, len(f.admitted), f.n, len(f.reports), f.tokens, resent)
	}
	if resent == 0 {
		t.Error("no report was resent: the 503 path is not exercised")
	}
}
