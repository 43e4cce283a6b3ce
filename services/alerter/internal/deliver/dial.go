package deliver

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"syscall"
	"time"
)

// ErrForbiddenAddress is wrapped by a delivery's error when the webhook's
// host resolved to an address outside the public internet and the
// webhook does not allow private destinations.
var ErrForbiddenAddress = errors.New("destination address not allowed")

// nonPublic are ranges that IsPrivate and friends do not cover but that
// no public webhook lives in.
var nonPublic = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),      // "this network"
	netip.MustParsePrefix("100.64.0.0/10"),  // carrier-grade NAT
	netip.MustParsePrefix("192.0.0.0/24"),   // IETF protocol assignments
	netip.MustParsePrefix("198.18.0.0/15"),  // benchmarking
	netip.MustParsePrefix("240.0.0.0/4"),    // reserved, broadcast
	netip.MustParsePrefix("64:ff9b:1::/48"), // local-use NAT64
	netip.MustParsePrefix("2001:db8::/32"),  // documentation
	netip.MustParsePrefix("fec0::/10"),      // deprecated site-local
	netip.MustParsePrefix("100::/64"),       // discard-only
	netip.MustParsePrefix("2001:10::/28"),   // ORCHID
	netip.MustParsePrefix("::ffff:0:0/96"),  // IPv4-mapped (checked unmapped)
	netip.MustParsePrefix("::/128"),         // unspecified
	netip.MustParsePrefix("169.254.0.0/16"), // link-local, cloud metadata
	netip.MustParsePrefix("fe80::/10"),      // link-local
	netip.MustParsePrefix("fc00::/7"),       // unique local
	netip.MustParsePrefix("127.0.0.0/8"),    // loopback
	netip.MustParsePrefix("::1/128"),        // loopback
	netip.MustParsePrefix("10.0.0.0/8"),     // private
	netip.MustParsePrefix("172.16.0.0/12"),  // private
	netip.MustParsePrefix("192.168.0.0/16"), // private
	netip.MustParsePrefix("255.255.255.255/32"),
}

// Public reports whether a is a public unicast address: not loopback,
// private, link-local, multicast, unspecified or otherwise reserved. An
// IPv6 address that carries an IPv4 one to reach it (mapped, NAT64,
// 6to4, compatible, translated) is judged by that IPv4 address too.
func Public(a netip.Addr) bool {
	a = a.Unmap()
	if !a.IsValid() || a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsInterfaceLocalMulticast() || a.IsMulticast() || a.IsUnspecified() {
		return false
	}
	for _, p := range nonPublic {
		if p.Contains(a) {
			return false
		}
	}
	if v4, ok := carried(a); ok {
		return Public(v4)
	}
	return true
}

// Prefixes of IPv6 addresses that carry an IPv4 address: a NAT64 gateway
// or a 6to4 relay on the alerter's network would connect to it, so a
// hostile name resolving to 64:ff9b::10.0.0.1 reaches 10.0.0.1.
var (
	nat64      = netip.MustParsePrefix("64:ff9b::/96")    // well-known NAT64: its last 32 bits
	compatible = netip.MustParsePrefix("::/96")           // deprecated IPv4-compatible: its last 32 bits
	translated = netip.MustParsePrefix("::ffff:0:0:0/96") // IPv4-translated (SIIT): its last 32 bits
	sixToFour  = netip.MustParsePrefix("2002::/16")       // 6to4: bits 16 to 47
)

// carried is the IPv4 address a carries, if a is of such a prefix.
func carried(a netip.Addr) (netip.Addr, bool) {
	b := a.As16()
	switch {
	case !a.Is6():
		return netip.Addr{}, false
	case nat64.Contains(a), compatible.Contains(a), translated.Contains(a):
		return netip.AddrFrom4([4]byte(b[12:16])), true
	case sixToFour.Contains(a):
		return netip.AddrFrom4([4]byte(b[2:6])), true
	}
	return netip.Addr{}, false
}

// publicOnly is a net.Dialer Control function: it runs after DNS
// resolution, on the very address about to be connected, so a name that
// resolves to a private address (or is re-bound to one between checks)
// cannot reach it.
func publicOnly(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("%w: cannot parse %q", ErrForbiddenAddress, address)
	}
	if !Public(ap.Addr()) {
		return fmt.Errorf("%w: %s is not a public address (set allow_private to permit it)", ErrForbiddenAddress, ap.Addr())
	}
	return nil
}

// newClient returns the HTTP client of one webhook: no proxy (a proxy
// would connect on our behalf, past the address check), no redirects
// (a 3xx is a failed attempt), and, unless allowPrivate, a dialer that
// connects to public addresses only. Timeouts come from each request's
// context.
func newClient(allowPrivate bool) *http.Client {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	if !allowPrivate {
		dialer.Control = publicOnly
	}
	return &http.Client{
		Transport: &http.Transport{
			Proxy:                 nil,
			DialContext:           dialer.DialContext,
			TLSHandshakeTimeout:   10 * time.Second,
			ResponseHeaderTimeout: 30 * time.Second,
			MaxIdleConnsPerHost:   4,
			IdleConnTimeout:       90 * time.Second,
			ForceAttemptHTTP2:     true,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}
