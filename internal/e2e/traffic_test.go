package e2e

import (
	"slices"
	"testing"
)

// Unfounded flags exactly the threshold alerts whose used exceeds what the
// traffic of their user (or of the tenant's users) can have caused.
func TestUnfounded(t *testing.T) {
	s := NewStats()
	a, b := User{Tenant: "acme", Name: "a"}, User{Tenant: "acme", Name: "b"}
	s.cause(a, 600, 1)
	s.cause(a, 100, 0) // an actual 100 over its estimate
	s.cause(b, 300, 1)
	s.cause(User{Tenant: "other", Name: "a"}, 5000, 1)
	alerts := []ThresholdAlert{
		{Tenant: "acme", User: "a", LimitName: "5h", Unit: "tokens", Used: 700},     // all of a's
		{Tenant: "acme", User: "a", LimitName: "5h", Unit: "tokens", Used: 701},     // more than a sent
		{Tenant: "acme", LimitName: "month", Unit: "tokens", Used: 1000},            // the tenant's sum
		{Tenant: "acme", LimitName: "month", Unit: "tokens", Used: 1001},            // more than acme sent
		{Tenant: "acme", User: "b", LimitName: "daily", Unit: "requests", Used: 1},  // b's one request
		{Tenant: "acme", User: "b", LimitName: "daily", Unit: "requests", Used: 2},  // b had one admitted
		{Tenant: "acme", User: "new", LimitName: "30d", Unit: "tokens", Used: 9100}, // a user with no traffic
	}
	got := s.Unfounded(alerts)
	want := []ThresholdAlert{alerts[1], alerts[3], alerts[5], alerts[6]}
	if !slices.Equal(got, want) {
		t.Fatalf("Unfounded = %v, want %v", got, want)
	}
}
