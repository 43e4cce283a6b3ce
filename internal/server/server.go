// Package server runs an HTTP server whose lifetime a service's run
// function owns: Listen binds at once (so a taken port fails start-up, not
// some goroutine later), Shutdown stops intake, waits for in-flight
// requests and for the serving goroutine.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// Server is one listening http.Server. Create it with Listen.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan error
}

// WriteTimeout bounds a whole request and its response: a handler that
// answers later has its answer cut.
const WriteTimeout = 30 * time.Second

// Listen binds addr and serves h on it from a goroutine that Shutdown
// waits for. The server has conservative timeouts: 5 s to read a request's
// headers, 30 s for a whole request and its response, 2 min idle. Errors
// of the serving loop are logged to log under the given name.
func Listen(addr, name string, h http.Handler, log *slog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s on %s: %w", name, addr, err)
	}
	s := &Server{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 5 * time.Second,
			ReadTimeout:       30 * time.Second,
			WriteTimeout:      WriteTimeout,
			IdleTimeout:       2 * time.Minute,
			MaxHeaderBytes:    64 << 10,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		ln:   ln,
		done: make(chan error, 1),
	}
	go func() {
		err := s.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		if err != nil {
			log.Error("http server stopped", "server", name, "err", err)
		}
		s.done <- err
	}()
	return s, nil
}

// Addr returns the address the server listens on (useful with ":0").
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Shutdown stops accepting connections, waits until in-flight requests
// finish or ctx ends (then closes the remaining connections), and waits
// for the serving goroutine.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		_ = s.srv.Close()
	}
	if serr := <-s.done; err == nil {
		err = serr
	}
	return err
}
