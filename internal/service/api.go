package service

import (
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"

	"quotaflow/internal/auth"
	"quotaflow/internal/server"
)

// OpenTokens returns the API tokens t configures (nil when none is: no
// authentication), the tokens file reloaded until the stack stops.
func OpenTokens(s *Stack, t auth.Tokens, log *slog.Logger) (*auth.Auth, error) {
	tokens, err := auth.New(t.Options(log, nil))
	if err != nil {
		return nil, err
	}
	s.Go("tokens file", tokens.Watch)
	return tokens, nil
}

// ListenAPI is Listen for an API that serves tenants' data, authenticated
// by tokens (OpenTokens): without a token every request would act for
// every tenant, so it then listens on loopback only (APIAddr) and answers
// only requests addressed to a loopback host (LoopbackHosts).
func ListenAPI(s *Stack, name, addrKey, addr string, tokens *auth.Auth, h http.Handler) (*server.Server, error) {
	if tokens == nil {
		h = LoopbackHosts(h)
	}
	return Listen(s, name, APIAddr(s, name, addrKey, addr, tokens), h)
}

// APIAddr is the address a listener that serves tenants' data binds:
// addr, or without tokens its port on loopback (LoopbackUnless), with a
// warning that logs that address under addrKey. Listeners that are not
// HTTP (admission's gRPC server) use it alone.
func APIAddr(s *Stack, name, addrKey, addr string, tokens *auth.Auth) string {
	a := LoopbackUnless(tokens != nil, addr)
	if a != addr {
		s.log.Warn("no API token is configured (QF_API_TOKENS, QF_API_TOKENS_FILE): the "+name+" serves every tenant and listens on loopback only",
			addrKey, a)
	}
	return a
}

// LoopbackHosts answers 421 to a request whose Host is not a loopback
// name or address. A listener on loopback is not enough without tokens: a
// web page the operator opens can point its own name at 127.0.0.1 (DNS
// rebinding) and read the API as its own origin; its requests name the
// page's host.
func LoopbackHosts(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if hp, _, err := net.SplitHostPort(host); err == nil {
			host = hp
		}
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
		if ip, err := netip.ParseAddr(host); !(err == nil && ip.IsLoopback() || strings.EqualFold(host, "localhost")) {
			http.Error(w, "without API tokens this API answers only requests to a loopback host", http.StatusMisdirectedRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// LoopbackUnless returns addr, or when not authenticated its port on
// 127.0.0.1 unless its host already is a loopback one.
func LoopbackUnless(authenticated bool, addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if authenticated || err != nil {
		return addr
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.IsLoopback() || host == "localhost" {
		return addr
	}
	return net.JoinHostPort("127.0.0.1", port)
}
