package server

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"
)

func TestListenServeShutdown(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	arrived, release := make(chan struct{}), make(chan struct{})
	s, err := Listen("127.0.0.1:0", "test", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		<-release
		_, _ = io.WriteString(w, "done")
	}), log)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(s.Addr(), "again", http.NotFoundHandler(), log); err == nil {
		t.Error("Listen on a taken address = nil error")
	}
	got := make(chan string, 1)
	go func() {
		resp, err := http.Get("http://" + s.Addr())
		if err != nil {
			got <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got <- string(b)
	}()
	<-arrived // shut down with the request in flight
	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(context.Background()) }()
	close(release)
	if b := <-got; b != "done" {
		t.Errorf("in-flight request got %q, want it finished", b)
	}
	if err := <-shut; err != nil {
		t.Errorf("Shutdown = %v", err)
	}
}
