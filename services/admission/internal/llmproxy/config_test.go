package llmproxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestParseKeys(t *testing.T) {
	for _, tc := range []struct {
		entry, key string
		want       Identity
		err        string
	}{
		{entry: "sk-1=acme/alice", key: "sk-1", want: Identity{"acme", "alice"}},
		// The key ends at the last '=', the tenant at the first '/'.
		{entry: "c2stMQ===acme/team/alice", key: "c2stMQ==", want: Identity{"acme", "team/alice"}},
		{entry: "sk-1", err: "want apikey=tenant/user"},
		{entry: "sk-1=acme", err: "no '/'"},
		{entry: "=acme/alice", err: "the key is empty"},
		{entry: "sk-1=/alice", err: "tenant: required"},
		{entry: "sk-1=acme/", err: "user: required"},
		{entry: "sk-1=acme/al\x01ice", err: "user: contains a control character"},
		{entry: "sk-1=acme/" + strings.Repeat("u", 257), err: "user: longer than 256 bytes"},
	} {
		ks, err := ParseKeys([]string{tc.entry})
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseKeys(%q) error = %v, want one with %q", tc.entry, err, tc.err)
			}
			if err != nil && strings.Contains(err.Error(), "sk-1") {
				t.Errorf("ParseKeys(%q) error %q repeats the key", tc.entry, err)
			}
			continue
		}
		if err != nil || len(ks) != 1 {
			t.Fatalf("ParseKeys(%q) = %v, %v", tc.entry, ks, err)
		}
		if got, ok := lookupKey(ks, tc.key); !ok || got != tc.want {
			t.Errorf("lookupKey(%q) = %v, %v; want %v", tc.key, got, ok, tc.want)
		}
		if _, ok := lookupKey(ks, tc.key+"x"); ok {
			t.Errorf("lookupKey(%q) found a key never configured", tc.key+"x")
		}
	}
}

func TestBuildFile(t *testing.T) {
	digest := sha256.Sum256([]byte("sk-hashed"))
	env := map[string]string{"OPENAI_KEY": "up-secret"}
	file := `
upstreams:
  - {name: openai, base_url: "https://api.example/v1/", api_key_env: OPENAI_KEY, models: [gpt-4o, "gpt-4.1*"]}
keys:
  - {key: sk-file, tenant: acme, user: bob}
  - {sha256: ` + hex.EncodeToString(digest[:]) + `, tenant: acme, user: carol}
pass: [/v1/models, "/v1/files*"]
trusted_headers: {tenant: x-tenant, user: x-user, peers: [10.0.0.0/8]}
`
	c, err := Build(Settings{GatewayUpstream: "http://127.0.0.1:8000/v1", GatewayKeys: []string{"sk-env=acme/alice"}}, []byte(file),
		func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	for model, want := range map[string]string{"gpt-4o": "openai", "gpt-4.1-mini": "openai", "gpt-4o-mini": "QF_GATEWAY_UPSTREAM", "llama": "QF_GATEWAY_UPSTREAM"} {
		if u := c.route(model); u == nil || u.Name != want {
			t.Errorf("route(%q) = %v, want %s", model, u, want)
		}
	}
	if u := c.route("gpt-4o"); u.apiKey != "up-secret" || u.base.String() != "https://api.example/v1" {
		t.Errorf("openai upstream = key %q base %s", u.apiKey, u.base)
	}
	for key, want := range map[string]Identity{"sk-env": {"acme", "alice"}, "sk-file": {"acme", "bob"}, "sk-hashed": {"acme", "carol"}} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", nil)
		r.Header.Set("Authorization", "Bearer "+key)
		if got, ok := c.identify(r); !ok || got != want {
			t.Errorf("identify(key %s) = %v, %v; want %v", key, got, ok, want)
		}
	}
	for path, want := range map[string]bool{"/v1/models": true, "/v1/models/x": false, "/v1/files/abc": true, "/v1/batches": false} {
		if c.passes(path) != want {
			t.Errorf("passes(%q) = %v, want %v", path, !want, want)
		}
	}
	// Trusted headers count from a trusted peer only.
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil)
	r.Header.Set("X-Tenant", "outer")
	r.Header.Set("X-User", "dave")
	r.RemoteAddr = "10.1.2.3:5555"
	if got, ok := c.identify(r); !ok || got != (Identity{"outer", "dave"}) {
		t.Errorf("identify(trusted peer) = %v, %v", got, ok)
	}
	r.RemoteAddr = "192.0.2.1:5555"
	if got, ok := c.identify(r); ok {
		t.Errorf("identify(untrusted peer with headers) = %v, want none", got)
	}
	// An outer gateway that appends instead of overwriting leaves the
	// client's value first: two values of either header are refused, a
	// valid key besides them included.
	for _, h := range []string{"X-Tenant", "X-User"} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", nil)
		r.Header.Set("Authorization", "Bearer sk-env")
		r.Header.Set("X-Tenant", "outer")
		r.Header.Set("X-User", "dave")
		r.Header[h] = append([]string{"spoofed"}, r.Header[h]...)
		r.RemoteAddr = "10.1.2.3:5555"
		if got, ok := c.identify(r); ok {
			t.Errorf("identify(two %s headers) = %v, want none", h, got)
		}
		// An appending gateway may join the values into one, comma-separated.
		own := r.Header[h][1]
		for _, joined := range []string{"spoofed, " + own, "spoofed," + own} {
			r.Header.Set(h, joined)
			if got, ok := c.identify(r); ok {
				t.Errorf("identify(%s: %q) = %v, want none", h, joined, got)
			}
		}
	}
}

// TestRoundTripCredentials: the caller's credentials (bearer key, api-key,
// x-api-key, cookies) never reach an upstream; the upstream's key goes in
// its auth_header, Authorization: Bearer by default.
func TestRoundTripCredentials(t *testing.T) {
	got := make(chan http.Header, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got <- r.Header.Clone() }))
	defer up.Close()
	file := `
upstreams:
  - {name: azure, base_url: "` + up.URL + `/v1", api_key_env: AZ, auth_header: api-key, models: [gpt-4o]}
  - {name: plain, base_url: "` + up.URL + `/v1", api_key_env: OAI}
  - {name: open, base_url: "` + up.URL + `/v1", models: [llama]}
`
	c, err := Build(Settings{}, []byte(file), func(k string) string { return map[string]string{"AZ": "az-secret", "OAI": "oai-secret"}[k] })
	if err != nil {
		t.Fatal(err)
	}
	px := &Proxy{transport: newTransport()}
	for model, want := range map[string]http.Header{
		"gpt-4o": {"Api-Key": {"az-secret"}},
		"other":  {"Authorization": {"Bearer oai-secret"}},
		"llama":  {},
	} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", nil)
		for _, h := range []string{"Authorization", "Api-Key", "X-Api-Key", "Cookie"} {
			r.Header.Set(h, "caller-secret")
		}
		r.Header.Set("X-Trace", "kept")
		resp, err := px.roundTrip(context.Background(), r, c.route(model), newSentBody([]byte("{}"), func() {}))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		h := <-got
		for _, k := range []string{"Authorization", "Api-Key", "X-Api-Key", "Cookie"} {
			if v := h.Values(k); strings.Join(v, ",") != strings.Join(want.Values(k), ",") {
				t.Errorf("%s: upstream got %s: %q, want %q", model, k, v, want.Values(k))
			}
		}
		if h.Get("X-Trace") != "kept" {
			t.Errorf("%s: other headers dropped: %v", model, h)
		}
	}
}

func TestBuildErrors(t *testing.T) {
	digest := sha256.Sum256([]byte("sk-twice"))
	twice := hex.EncodeToString(digest[:])
	for _, tc := range []struct {
		name, file string
		s          Settings
		want       []string
	}{
		{name: "no upstream", file: "keys: []", want: []string{"no upstream"}},
		{name: "unknown field, key not quoted", file: "kes:\n  - {key: sk-secret}\n",
			s: Settings{GatewayUpstream: "http://u/v1"}, want: []string{"line 1: unknown field kes"}},
		{name: "wrong type, key not quoted", file: "keys: sk-secret\n",
			s: Settings{GatewayUpstream: "http://u/v1"}, want: []string{"line 1: wrong type of value"}},
		{name: "upstream mistakes", file: `
upstreams:
  - {name: a, base_url: "ftp://x"}
  - {name: a, base_url: "http://user:sk-secret@x/v1", api_key_env: NOPE}
  - {base_url: "http://x/v1", models: ["*"]}
`, want: []string{"upstreams[0].base_url: want an http or https URL", "upstreams[1].name: \"a\" names an earlier upstream too",
			"upstreams[1].base_url: must not hold credentials", "upstreams[1].api_key_env: $NOPE is empty or unset",
			"upstreams[1]: a second default upstream", "upstreams[2].name: required", "upstreams[2].models[0]"}},
		{name: "key mistakes", s: Settings{GatewayUpstream: "http://u/v1", GatewayKeys: []string{"sk-env=t/u"}}, file: `
keys:
  - {key: sk-secret, sha256: abc, tenant: t, user: u}
  - {sha256: abc, tenant: t, user: u}
  - {key: sk-secret, user: u}
  - {key: sk-env, tenant: t, user: v}
  - {key: sk-twice, tenant: t, user: u}
  - {sha256: ` + hex.EncodeToString(sha256.New().Sum([]byte(nil))) + `, tenant: t, user: u}
  - {sha256: ` + twice + `, tenant: t, user: w}
`, want: []string{"keys[0]: give key or sha256, not both", "keys[1].sha256: want the 64 hex digits", "keys[2].tenant: required",
			"keys[3]: the same key as QF_GATEWAY_KEYS' key 1", "keys[6]: the same key as QF_GATEWAY_FILE: keys[4]"}},
		{name: "a key twice in QF_GATEWAY_KEYS", s: Settings{GatewayUpstream: "http://u/v1", GatewayKeys: []string{"sk-secret=t/a", "sk-secret=t/b"}}, file: "{}",
			want: []string{"QF_GATEWAY_KEYS: entry 2: the same key as QF_GATEWAY_KEYS: entry 1"}},
		{name: "pass and trusted", s: Settings{GatewayUpstream: "http://u/v1"}, file: `
pass: [/v1/chat/completions, /admin, "/v1/*", "/v1/chat*", "/v1/em*", "/v1/responses*"]
trusted_headers: {tenant: x-t, user: x-t, peers: [nope]}
`, want: []string{"pass[0]: /v1/chat/completions covers /v1/chat/completions, which is metered", "pass[1]: want a path under /v1/",
			"pass[2]: /v1/* covers /v1/", "pass[3]: /v1/chat* covers /v1/chat/completions", "pass[4]: /v1/em* covers /v1/embeddings",
			"pass[5]: /v1/responses* covers /v1/responses",
			"trusted_headers: tenant and user must name two headers", "trusted_headers.peers[0]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Build(tc.s, []byte(tc.file), func(string) string { return "" })
			if err == nil {
				t.Fatal("Build succeeded, want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Build error\n%v\nlacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "sk-secret") {
				t.Errorf("Build error repeats a key: %v", err)
			}
		})
	}
}

func TestSettingsValidate(t *testing.T) {
	for _, tc := range []struct {
		s    Settings
		want string
	}{
		{Settings{GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, ""},
		{Settings{GatewayKeys: []string{"k=t/u"}, GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, "QF_GATEWAY_KEYS: set without QF_GATEWAY_ADDR"},
		{Settings{GatewayAddr: ":8081", GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, "QF_GATEWAY_UPSTREAM: required"},
		{Settings{GatewayAddr: ":8081", GatewayUpstream: "localhost:8000", GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, "QF_GATEWAY_UPSTREAM: want an http or https URL"},
		{Settings{GatewayAddr: ":8081", GatewayUpstream: "http://u/v1", GatewayDefaultMaxTokens: 0, GatewayReferenceTokens: 1}, "QF_GATEWAY_DEFAULT_MAX_TOKENS"},
		{Settings{GatewayAddr: ":8081", GatewayUpstream: "http://u/v1", GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1<<20 + 1}, "QF_GATEWAY_REFERENCE_TOKENS: 1048577: want 1 to 1048576"},
		{Settings{GatewayAddr: ":8081", GatewayUpstream: "http://u/v1", GatewayKeys: []string{"k=t"}, GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, "QF_GATEWAY_KEYS: entry 1"},
		{Settings{GatewayAddr: ":8081", GatewayUpstream: "http://u/v1", GatewayKeys: []string{"k=t/u"}, GatewayDefaultMaxTokens: 1, GatewayReferenceTokens: 1}, ""},
	} {
		err := tc.s.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.s, err, tc.want)
		}
	}
}

// TestWatcherReload: a new key in the file is in force after the reload,
// a removed one is not, and a broken file keeps the last good keys.
func TestWatcherReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "gateway.yaml")
	write := func(s string) {
		t.Helper()
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write("keys: [{key: old, tenant: t, user: u}]\n")
	var mu sync.Mutex
	var reloads []error
	w, err := NewWatcher(Settings{GatewayUpstream: "http://u/v1", GatewayFile: path}, os.Getenv, nil, func(err error) {
		mu.Lock()
		defer mu.Unlock()
		reloads = append(reloads, err)
	})
	if err != nil {
		t.Fatal(err)
	}
	known := func(key string) bool { _, ok := lookupKey(w.Current().keys, key); return ok }
	if !known("old") || known("new") {
		t.Fatal("initial keys wrong")
	}
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { w.Watch(ctx) })
	defer func() { cancel(); wg.Wait() }()

	write("keys: [{key: new, tenant: t, user: u}]\n")
	waitFor(t, func() bool { return known("new") && !known("old") })
	write("keys: [{key: broken\n")
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(reloads) == 2 })
	if !known("new") {
		t.Error("a broken file took the last good keys out of force")
	}
	mu.Lock()
	defer mu.Unlock()
	if reloads[0] != nil || reloads[1] == nil {
		t.Errorf("reloads = %v, want [nil, error]", reloads)
	}
}

// waitFor polls cond (a file watch or a stream delivers in its own time).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
