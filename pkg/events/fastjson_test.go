package events

import (
	"bytes"
	"testing"
	"time"
)

// fastAndSlow returns the hand-written and the encoding/json encodings of
// e; ok says whether the hand-written one applied.
func fastAndSlow(t *testing.T, e Event) (fast, slow []byte, ok bool) {
	t.Helper()
	fast, ok = appendFast(nil, &e)
	slow, err := e.marshalSlow()
	if err != nil {
		if ok {
			t.Fatalf("encoding/json refuses %+v (%v) but the fast path wrote %s", e, err, fast)
		}
		return nil, nil, false
	}
	return fast, slow, ok
}

func TestFastJSONMatches(t *testing.T) {
	at := time.Date(2026, 11, 30, 9, 41, 7, 123456700, time.UTC)
	limits := []LimitState{
		{Scope: "user", Name: "5h", Unit: "tokens", Limit: 30000, Used: 1200, Remaining: 28800, ResetSeconds: 750},
		{Scope: "user", Name: "daily", Endpoint: "/v1/chat", Unit: "requests", Limit: 100, Used: 101, Remaining: -1},
	}
	full := Reserved{RequestID: "r-1", Tenant: "acme", User: "u-42", Plan: "pro", Endpoint: "/v1/chat",
		Model: "gpt-x", IP: "2001:db8::1", EstimatedTokens: 1200, ExpiresAt: at.Add(24 * time.Hour).In(time.FixedZone("X", 5*3600+1800)),
		Version: 1764495667123456, TenantVersion: 7, Limits: limits,
		WouldDeny: []LimitRef{{Scope: "tenant", Name: "month"}, {Scope: "global", Name: "rpm", Endpoint: "/v1/chat"}}}
	cases := map[string]Event{
		"reserved, every field": NewReserved("quotaflow/admission", full, at),
		"reserved, bare":        NewReserved("quotaflow/admission", Reserved{RequestID: "r", Tenant: "t", User: "u", Endpoint: "/"}, at),
		"local decision":        NewReserved("quotaflow/admission", Reserved{RequestID: "r", Tenant: "t", User: "u", Endpoint: "/x", Limits: []LimitState{}}, at.Truncate(time.Second)),
		"corrected":             NewCorrected("quotaflow/accounter", Corrected{RequestID: "r", Tenant: "t/with/slash", User: "u", Plan: "pro", Delta: -350, Version: 3, Limits: limits}, at),
		"corrected, bare":       NewCorrected("quotaflow/accounter", Corrected{RequestID: "r", Tenant: "t", User: "u"}, at),
		"html characters":       NewReserved("a<b>&c", Reserved{RequestID: "<r>", Tenant: "t&", User: "u", Endpoint: "/a?b=1&c=<2>"}, at),
		"actual":                NewActual("svc", Actual{RequestID: "r", Tenant: "t", User: "u", Endpoint: "/v1/chat", Model: "gpt-x", InputTokens: 40, OutputTokens: 1_000_000_000_000}, at),
		"actual, bare":          NewActual("svc", Actual{RequestID: "r", Tenant: "t", User: "u"}, at),
		"released":              NewReleased("quotaflow/admission", Released{RequestID: "r", Tenant: "t", User: "u", Status: ReleaseReleased, ReturnedTokens: 120}, at),
		"released, bare":        NewReleased("svc", Released{RequestID: "r", Tenant: "t", User: "u"}, at),
	}
	for name, e := range cases {
		fast, slow, ok := fastAndSlow(t, e)
		if !ok {
			t.Errorf("%s: fast path not taken", name)
		} else if !bytes.Equal(fast, slow) {
			t.Errorf("%s:\nfast %s\nslow %s", name, fast, slow)
		}
	}
	// What needs escaping, or a time MarshalJSON refuses, goes the slow way.
	for name, e := range map[string]Event{
		"quote":         NewReserved("s", Reserved{RequestID: `r"1`, Tenant: "t", User: "u", Endpoint: "/"}, at),
		"non-ascii":     NewCorrected("s", Corrected{RequestID: "r", Tenant: "tenant-é", User: "u"}, at),
		"control":       NewReserved("s", Reserved{RequestID: "r", Tenant: "t", User: "u\n", Endpoint: "/"}, at),
		"year 10000":    NewReserved("s", Reserved{RequestID: "r", Tenant: "t", User: "u", Endpoint: "/", ExpiresAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, at),
		"another type":  NewTopUp("s", TopUp{Tenant: "t", Amount: 1, Reference: "ref"}, at),
		"actual, quote": NewActual("s", Actual{RequestID: "r", Tenant: "t", User: "u", Model: `m"`}, at),
	} {
		if _, ok := appendFast(nil, &e); ok {
			t.Errorf("%s: fast path taken", name)
		}
		if _, err := e.MarshalJSON(); err != nil && name != "year 10000" {
			t.Errorf("%s: MarshalJSON = %v", name, err)
		}
	}
}

// FuzzFastJSON holds the hand-written encoding to encoding/json's for any
// Reserved, Corrected, Actual or Released event.
func FuzzFastJSON(f *testing.F) {
	f.Add("r-1", "acme", "u-42", "/v1/chat", "5h", int64(1200), int64(1764495667123456), int64(1764495667), int64(-5), uint8(0))
	f.Add("r\"", "t\\", "u\x00", "é", "", int64(0), int64(0), int64(-1<<62), int64(0), uint8(1))
	f.Add("<r>", "t&", "u", "/a?b=1", "n", int64(-1), int64(1), int64(253402300799), int64(3600), uint8(0))
	f.Add("r-2", "acme", "u", "/v1/chat", "gpt-x", int64(40), int64(7), int64(1764495667), int64(0), uint8(2))
	f.Add("r-3", "acme", "u", "", "released", int64(0), int64(120), int64(1764495667), int64(0), uint8(3))
	f.Fuzz(func(t *testing.T, req, tenant, user, endpoint, name string, n, version, unix, offset int64, kind uint8) {
		at := time.Unix(unix%(1<<40), n%1e9).In(time.FixedZone("", int(offset%(30*3600))))
		ls := []LimitState{{Scope: "user", Name: name, Endpoint: endpoint, Unit: "tokens", Limit: n, Used: version, Remaining: n - version, ResetSeconds: unix}}
		var e Event
		switch kind % 4 {
		case 0:
			e = NewReserved(user, Reserved{RequestID: req, Tenant: tenant, User: user, Plan: name, Endpoint: endpoint, IP: name,
				EstimatedTokens: n, ExpiresAt: at, Version: version, TenantVersion: n, Limits: ls,
				WouldDeny: []LimitRef{{Scope: "user", Name: name, Endpoint: endpoint}}}, at)
		case 1:
			e = NewCorrected(tenant, Corrected{RequestID: req, Tenant: tenant, User: user, Delta: n, Version: version, TenantVersion: unix, Limits: ls}, at)
		case 2:
			e = NewActual(tenant, Actual{RequestID: req, Tenant: tenant, User: user, Endpoint: endpoint, Model: name, InputTokens: n, OutputTokens: version}, at)
		case 3:
			e = NewReleased(tenant, Released{RequestID: req, Tenant: tenant, User: user, Status: name, ReturnedTokens: n}, at)
		}
		e.Time = at // as given, not only UTC
		fast, slow, ok := fastAndSlow(t, e)
		if ok && !bytes.Equal(fast, slow) {
			t.Fatalf("fast %s\nslow %s", fast, slow)
		}
	})
}
