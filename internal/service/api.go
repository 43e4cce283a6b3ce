package service

import (
	"log/slog"
	"net"
	"net/http"
	"net/netip"

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

// ListenAPI is Listen for an API that reads tenants' data, authenticated
// by tokens (OpenTokens): without a token every request would read every
// tenant, so it then listens on loopback only (LoopbackUnless), with a
// warning that logs the address under addrKey.
func ListenAPI(s *Stack, name, addrKey, addr string, tokens *auth.Auth, h http.Handler) (*server.Server, error) {
	if a := LoopbackUnless(tokens != nil, addr); a != addr {
		s.log.Warn("no API token is configured (QF_API_TOKENS, QF_API_TOKENS_FILE): the "+name+" reads every tenant and listens on loopback only",
			addrKey, a)
		addr = a
	}
	return Listen(s, name, addr, h)
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
