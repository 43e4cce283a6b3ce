package llmproxy

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"strings"

	"go.yaml.in/yaml/v3"

	"quotaflow/pkg/ident"
	"quotaflow/services/admission/internal/openai"
)

// Settings are the gateway mode's environment variables; admission's
// Config embeds them (prefix QF). With GatewayAddr empty there is no gateway.
type Settings struct {
	// GatewayAddr is where the gateway listens (QF_GATEWAY_ADDR); empty: no gateway.
	GatewayAddr string `envconfig:"GATEWAY_ADDR"`
	// GatewayUpstream is the base URL of one OpenAI-compatible upstream, e.g.
	// http://127.0.0.1:8000/v1 (QF_GATEWAY_UPSTREAM): every model goes there
	// unless the file routes it elsewhere.
	GatewayUpstream string `envconfig:"GATEWAY_UPSTREAM"`
	// GatewayKeys are "apikey=tenant/user" entries (QF_GATEWAY_KEYS): the key ends
	// at the last '=', the tenant at the first '/'.
	GatewayKeys []string `envconfig:"GATEWAY_KEYS"`
	// GatewayFile is the YAML file of upstreams, routing, keys, passed paths and
	// trusted headers (QF_GATEWAY_FILE; Build), reloaded on change.
	GatewayFile string `envconfig:"GATEWAY_FILE"`
	// GatewayDefaultMaxTokens is the output maximum set on a request that sets
	// none (QF_GATEWAY_DEFAULT_MAX_TOKENS), so that the actual can never
	// exceed the estimate.
	GatewayDefaultMaxTokens int64 `envconfig:"GATEWAY_DEFAULT_MAX_TOKENS"`
	// GatewayReferenceTokens are the input tokens reserved for each file
	// part and each stored context (previous_response_id, conversation) a
	// request points to (QF_GATEWAY_REFERENCE_TOKENS): the body holds none
	// of their text.
	GatewayReferenceTokens int64 `envconfig:"GATEWAY_REFERENCE_TOKENS"`
}

// DefaultMaxTokens is QF_GATEWAY_DEFAULT_MAX_TOKENS's default: 4096, the
// output limit of many current models, so that a request without a
// maximum is rarely cut short and never reserves more than a long answer.
const DefaultMaxTokens = 4096

// maxDefaultMaxTokens bounds QF_GATEWAY_DEFAULT_MAX_TOKENS: no model
// answers more than a million tokens.
const maxDefaultMaxTokens = 1 << 20

// DefaultSettings are the defaults this package owns.
var DefaultSettings = Settings{GatewayDefaultMaxTokens: DefaultMaxTokens, GatewayReferenceTokens: openai.DefaultReferenceTokens}

// Validate checks the settings without reading the file (run does), each
// problem naming its variable; it never repeats a key.
func (s *Settings) Validate() error {
	if s.GatewayAddr == "" {
		var set []string
		for _, v := range []struct {
			name string
			set  bool
		}{{"QF_GATEWAY_UPSTREAM", s.GatewayUpstream != ""}, {"QF_GATEWAY_KEYS", len(s.GatewayKeys) > 0}, {"QF_GATEWAY_FILE", s.GatewayFile != ""}} {
			if v.set {
				set = append(set, v.name)
			}
		}
		if len(set) > 0 {
			return fmt.Errorf("%s: set without QF_GATEWAY_ADDR, so no gateway would use it", strings.Join(set, ", "))
		}
		return nil
	}
	var errs []error
	if s.GatewayUpstream == "" && s.GatewayFile == "" {
		errs = append(errs, errors.New("QF_GATEWAY_UPSTREAM: required with QF_GATEWAY_ADDR unless QF_GATEWAY_FILE names upstreams"))
	}
	if s.GatewayUpstream != "" {
		if _, err := parseBaseURL(s.GatewayUpstream); err != nil {
			errs = append(errs, fmt.Errorf("QF_GATEWAY_UPSTREAM: %w", err))
		}
	}
	if _, err := ParseKeys(s.GatewayKeys); err != nil {
		errs = append(errs, err)
	}
	if s.GatewayDefaultMaxTokens < 1 || s.GatewayDefaultMaxTokens > maxDefaultMaxTokens {
		errs = append(errs, fmt.Errorf("QF_GATEWAY_DEFAULT_MAX_TOKENS: %d: want 1 to %d", s.GatewayDefaultMaxTokens, maxDefaultMaxTokens))
	}
	if s.GatewayReferenceTokens < 1 || s.GatewayReferenceTokens > openai.MaxTokens {
		errs = append(errs, fmt.Errorf("QF_GATEWAY_REFERENCE_TOKENS: %d: want 1 to %d", s.GatewayReferenceTokens, openai.MaxTokens))
	}
	return errors.Join(errs...)
}

// Identity is whom a request is counted for.
type Identity struct{ Tenant, User string }

// Key is one API key of the gateway: its SHA-256 digest (the key itself is
// never kept) and whom it identifies.
type Key struct {
	digest [sha256.Size]byte
	Identity
}

// ParseKeys parses QF_GATEWAY_KEYS entries, "apikey=tenant/user": the key
// ends at the last '=' (base64 keys end in '='), the tenant at the first
// '/' (a user may hold '/'). Errors name the entry by its position, never
// by its key.
func ParseKeys(entries []string) ([]Key, error) {
	var out []Key
	var errs []error
	seen := map[[sha256.Size]byte]string{}
	for i, e := range entries {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		at := fmt.Sprintf("QF_GATEWAY_KEYS: entry %d", i+1)
		k, err := parseKey(e)
		if err == nil {
			err = repeated(seen, k.digest, at)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", at, err))
			continue
		}
		out = append(out, k)
	}
	return out, errors.Join(errs...)
}

// repeated records digest as at's key in seen and refuses one seen before:
// the same key for two identities would count for whichever came first.
func repeated(seen map[[sha256.Size]byte]string, digest [sha256.Size]byte, at string) error {
	if first, ok := seen[digest]; ok {
		return fmt.Errorf("the same key as %s", first)
	}
	seen[digest] = at
	return nil
}

func parseKey(e string) (Key, error) {
	eq := strings.LastIndexByte(e, '=')
	if eq < 0 {
		return Key{}, errors.New("want apikey=tenant/user")
	}
	key, id := e[:eq], e[eq+1:]
	tenant, user, ok := strings.Cut(id, "/")
	if !ok {
		return Key{}, errors.New("want apikey=tenant/user: no '/' after the last '='")
	}
	if key == "" {
		return Key{}, errors.New("the key is empty")
	}
	ident, err := checkIdentity(tenant, user)
	if err != nil {
		return Key{}, err
	}
	return Key{digest: sha256.Sum256([]byte(key)), Identity: ident}, nil
}

// checkIdentity validates a tenant and a user as every boundary of
// quotaflow does (package ident).
func checkIdentity(tenant, user string) (Identity, error) {
	for _, f := range []struct{ name, v string }{{"tenant", tenant}, {"user", user}} {
		if f.v == "" {
			return Identity{}, fmt.Errorf("%s: required", f.name)
		}
		if err := ident.Check(f.v); err != nil {
			return Identity{}, fmt.Errorf("%s: %w", f.name, err)
		}
	}
	return Identity{Tenant: tenant, User: user}, nil
}

// lookupKey returns the identity of key among keys. It compares the key's
// digest with every digest in constant time and selects the match without
// a branch, as package auth does for API tokens, so timing reveals neither
// which key matched nor how much of one was right.
func lookupKey(keys []Key, key string) (Identity, bool) {
	d := sha256.Sum256([]byte(key))
	match := -1
	for i := range keys {
		eq := subtle.ConstantTimeCompare(d[:], keys[i].digest[:])
		match = subtle.ConstantTimeSelect(eq, i, match)
	}
	if match < 0 {
		return Identity{}, false
	}
	return keys[match].Identity, true
}

// Upstream is one OpenAI-compatible server.
type Upstream struct {
	// Name names it in logs and errors.
	Name string
	// base is the base URL, e.g. http://127.0.0.1:8000/v1: a request's
	// path after /v1 is appended to it.
	base *url.URL
	// apiKey replaces the caller's credentials; "" sends none.
	apiKey string
	// authHeader carries apiKey: Authorization as "Bearer <key>" (the
	// default), any other header as the key alone (Azure's api-key).
	authHeader string
	// models are the models routed here: exact names, or prefixes ending
	// in '*'. None: the default upstream.
	models []string
}

// serves reports whether u is routed model.
func (u *Upstream) serves(model string) bool {
	for _, m := range u.models {
		if p, ok := strings.CutSuffix(m, "*"); ok && strings.HasPrefix(model, p) || m == model {
			return true
		}
	}
	return false
}

// Config is the gateway's configuration in force: the environment's and the
// file's together. It is immutable; Watcher swaps it whole.
type Config struct {
	upstreams []*Upstream // routed ones in file order, then the default
	fallback  *Upstream   // the upstream of models no other serves; may be nil
	keys      []Key
	pass      []string // other paths passed through: exact, or prefixes ending in '*'
	trusted   *trustedHeaders
}

// trustedHeaders name the headers an outer gateway sets with the caller's
// identity, and the peers whose headers are believed.
type trustedHeaders struct {
	tenant, user string
	peers        []netip.Prefix
}

// route returns the upstream of model, nil when none serves it.
func (c *Config) route(model string) *Upstream {
	for _, u := range c.upstreams {
		if u.serves(model) {
			return u
		}
	}
	return c.fallback
}

// passes reports whether a path other than the metered endpoints is passed
// through to the default upstream.
func (c *Config) passes(path string) bool {
	for _, p := range c.pass {
		if pre, ok := strings.CutSuffix(p, "*"); ok && strings.HasPrefix(path, pre) || p == path {
			return true
		}
	}
	return false
}

// identify returns whom r is for: from the trusted headers when its peer is
// trusted and sets them, else from its bearer key. It returns false when
// neither identifies it (401), or when a trusted peer sent either header
// more than once or with a comma in its value: an outer gateway that
// appended its value to the client's (as a second header or joined into
// one) instead of overwriting it, which only the client's could win.
func (c *Config) identify(r *http.Request) (Identity, bool) {
	if t := c.trusted; t != nil && t.from(r.RemoteAddr) {
		tenants, users := r.Header.Values(t.tenant), r.Header.Values(t.user)
		if len(tenants) > 1 || len(users) > 1 || joined(tenants) || joined(users) {
			return Identity{}, false
		}
		if len(tenants) == 1 && tenants[0] != "" {
			id, err := checkIdentity(tenants[0], r.Header.Get(t.user))
			return id, err == nil
		}
	}
	scheme, key, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return Identity{}, false
	}
	key = strings.TrimSpace(key)
	if key == "" {
		return Identity{}, false
	}
	return lookupKey(c.keys, key)
}

// joined reports whether a header's single value holds a comma: values an
// appending gateway joined into one.
func joined(values []string) bool {
	return len(values) == 1 && strings.Contains(values[0], ",")
}

// from reports whether the peer at addr (host:port) is trusted.
func (t *trustedHeaders) from(addr string) bool {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return false
	}
	a := ap.Addr().Unmap()
	for _, p := range t.peers {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// MaxFileSize is the largest QF_GATEWAY_FILE accepted (1 MiB).
const MaxFileSize = 1 << 20

// file is QF_GATEWAY_FILE's content; see ParseFile.
type file struct {
	Upstreams []struct {
		Name       string   `yaml:"name"`
		BaseURL    string   `yaml:"base_url"`
		APIKeyEnv  string   `yaml:"api_key_env"`
		AuthHeader string   `yaml:"auth_header"`
		Models     []string `yaml:"models"`
	} `yaml:"upstreams"`
	Keys []struct {
		Key    string `yaml:"key"`
		SHA256 string `yaml:"sha256"`
		Tenant string `yaml:"tenant"`
		User   string `yaml:"user"`
	} `yaml:"keys"`
	Pass           []string `yaml:"pass"`
	TrustedHeaders *struct {
		Tenant string   `yaml:"tenant"`
		User   string   `yaml:"user"`
		Peers  []string `yaml:"peers"`
	} `yaml:"trusted_headers"`
}

// Build returns the configuration of the settings and of the file's
// content (nil data: no file), every problem at once, each named by its
// variable or its path in the file ("upstreams[1].base_url: ..."). Keys
// never appear in errors. getenv reads the upstreams' api_key_env
// variables.
//
// The file (every part optional):
//
//	upstreams:                 # besides QF_GATEWAY_UPSTREAM
//	  - name: openai
//	    base_url: https://api.openai.com/v1
//	    api_key_env: OPENAI_API_KEY      # replaces the caller's credentials
//	    auth_header: api-key             # carries it (Azure); default Authorization: Bearer <key>
//	    models: [gpt-4o, "gpt-4.1*"]     # exact, or a prefix ending in '*'; none: the default
//	keys:                      # besides QF_GATEWAY_KEYS
//	  - {key: sk-team-a, tenant: acme, user: alice}     # or sha256: <64 hex digits of the key>
//	pass: [/v1/models, "/v1/files*"]  # other paths passed to the default upstream; the rest get 404
//	trusted_headers:           # identity set by an outer gateway
//	  {tenant: X-Quota-Tenant, user: X-Quota-User, peers: [10.0.3.7]}  # the gateways only; they overwrite both
//
// A model no upstream lists goes to the default one: QF_GATEWAY_UPSTREAM or
// the file's upstream without models (at most one of the two).
func Build(s Settings, data []byte, getenv func(string) string) (*Config, error) {
	c := &Config{}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	keys, err := ParseKeys(s.GatewayKeys)
	if err != nil {
		errs = append(errs, err)
	}
	c.keys = keys
	seen := map[[sha256.Size]byte]string{} // the keys' digests, for repeats
	for i, k := range keys {
		seen[k.digest] = fmt.Sprintf("QF_GATEWAY_KEYS' key %d", i+1)
	}
	if s.GatewayUpstream != "" {
		base, err := parseBaseURL(s.GatewayUpstream)
		if err != nil {
			bad("QF_GATEWAY_UPSTREAM: %w", err)
		}
		c.fallback = &Upstream{Name: "QF_GATEWAY_UPSTREAM", base: base, authHeader: "Authorization"}
	}
	var f file
	if data != nil {
		if len(data) > MaxFileSize {
			return nil, fmt.Errorf("QF_GATEWAY_FILE: larger than %d bytes", MaxFileSize)
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		dec.KnownFields(true)
		if err := dec.Decode(&f); err != nil {
			// yaml's errors quote the line's value, which could be a key.
			return nil, fmt.Errorf("QF_GATEWAY_FILE: %s", yamlProblem(err))
		}
	}
	names := map[string]bool{}
	for i, fu := range f.Upstreams {
		at := fmt.Sprintf("QF_GATEWAY_FILE: upstreams[%d]", i)
		u := &Upstream{Name: fu.Name, models: fu.Models, authHeader: "Authorization"}
		switch {
		case fu.Name == "":
			bad("%s.name: required", at)
		case ident.Check(fu.Name) != nil:
			bad("%s.name: %v", at, ident.Check(fu.Name))
		case names[fu.Name]:
			bad("%s.name: %q names an earlier upstream too", at, fu.Name)
		}
		names[fu.Name] = true
		if u.base, err = parseBaseURL(fu.BaseURL); err != nil {
			bad("%s.base_url: %w", at, err)
		}
		if fu.AuthHeader != "" {
			if strings.IndexFunc(fu.AuthHeader, notHeaderChar) >= 0 {
				bad("%s.auth_header: want a header name (letters, digits and '-')", at)
			}
			u.authHeader = http.CanonicalHeaderKey(fu.AuthHeader)
		}
		if fu.APIKeyEnv != "" {
			if u.apiKey = getenv(fu.APIKeyEnv); u.apiKey == "" {
				bad("%s.api_key_env: $%s is empty or unset", at, fu.APIKeyEnv)
			}
		}
		for j, m := range fu.Models {
			if m == "" || m == "*" || ident.Check(m) != nil {
				bad("%s.models[%d]: want a model name or a prefix ending in '*'", at, j)
			}
		}
		if len(fu.Models) > 0 {
			c.upstreams = append(c.upstreams, u)
			continue
		}
		if c.fallback != nil {
			bad("%s: a second default upstream (no models) besides %s", at, c.fallback.Name)
		}
		c.fallback = u
	}
	if c.fallback != nil {
		c.upstreams = append(c.upstreams, c.fallback)
	}
	if len(c.upstreams) == 0 {
		bad("QF_GATEWAY_UPSTREAM: no upstream: set it or list upstreams in QF_GATEWAY_FILE")
	}
	for i, fk := range f.Keys {
		at := fmt.Sprintf("QF_GATEWAY_FILE: keys[%d]", i)
		k := Key{}
		switch {
		case fk.Key != "" && fk.SHA256 != "":
			bad("%s: give key or sha256, not both", at)
		case fk.Key != "":
			k.digest = sha256.Sum256([]byte(fk.Key))
		case fk.SHA256 != "":
			d, err := hex.DecodeString(fk.SHA256)
			if err != nil || len(d) != sha256.Size {
				bad("%s.sha256: want the 64 hex digits of the key's SHA-256", at)
			}
			copy(k.digest[:], d)
		default:
			bad("%s: key or sha256 required", at)
		}
		if k.Identity, err = checkIdentity(fk.Tenant, fk.User); err != nil {
			bad("%s.%w", at, err)
		}
		if k.digest != ([sha256.Size]byte{}) {
			if err := repeated(seen, k.digest, at); err != nil {
				bad("%s: %w", at, err)
			}
		}
		c.keys = append(c.keys, k)
	}
	for i, p := range f.Pass {
		if !strings.HasPrefix(p, "/v1/") || ident.Check(p) != nil {
			bad("QF_GATEWAY_FILE: pass[%d]: want a path under /v1/, or a prefix of one ending in '*'", i)
		}
		if covered := coversMetered(p); covered != "" {
			bad("QF_GATEWAY_FILE: pass[%d]: %s covers %s, which is metered; it cannot be passed through unmetered", i, p, covered)
		}
	}
	c.pass = f.Pass
	if th := f.TrustedHeaders; th != nil {
		t := &trustedHeaders{tenant: http.CanonicalHeaderKey(th.Tenant), user: http.CanonicalHeaderKey(th.User)}
		if th.Tenant == "" || th.User == "" || th.Tenant == th.User {
			bad("QF_GATEWAY_FILE: trusted_headers: tenant and user must name two headers")
		}
		if len(th.Peers) == 0 {
			bad("QF_GATEWAY_FILE: trusted_headers.peers: required: the addresses of the outer gateways (a CIDR or an address each)")
		}
		for i, s := range th.Peers {
			p, err := parsePrefix(s)
			if err != nil {
				bad("QF_GATEWAY_FILE: trusted_headers.peers[%d]: %q is neither a CIDR nor an address", i, s)
			}
			t.peers = append(t.peers, p)
		}
		c.trusted = t
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// yamlProblem is a YAML error's message without the values it quotes (a
// misplaced key would be one): yaml.TypeError's lines keep only "line n:"
// and what was expected.
func yamlProblem(err error) string {
	var te *yaml.TypeError
	if !errors.As(err, &te) {
		return "not valid YAML (" + strings.SplitN(err.Error(), ":", 3)[0] + ")"
	}
	var out []string
	for _, e := range te.Errors {
		// "line 3: field kex not found in type ..." or "line 3: cannot unmarshal !!str `sk-...` into ..."
		line, rest, _ := strings.Cut(e, ": ")
		if strings.HasPrefix(rest, "field ") {
			field, _, _ := strings.Cut(strings.TrimPrefix(rest, "field "), " ")
			out = append(out, line+": unknown field "+field)
			continue
		}
		out = append(out, line+": wrong type of value")
	}
	return strings.Join(out, "; ")
}

// coversMetered returns the metered endpoint a pass entry (exact, or a
// prefix ending in '*') covers, "" when none.
func coversMetered(pass string) string {
	pre, prefix := strings.CutSuffix(pass, "*")
	for k := openai.Chat; k <= openai.Responses; k++ {
		if m := k.String(); m == pass || prefix && strings.HasPrefix(m, pre) {
			return m
		}
	}
	return ""
}

// parseBaseURL checks an upstream's base URL: http or https, a host, no
// query, fragment or credentials (keys come from api_key_env).
func parseBaseURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	switch {
	case err != nil || s == "":
		return nil, errors.New("not a URL")
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, errors.New("want an http or https URL")
	case u.Host == "":
		return nil, errors.New("no host")
	case u.User != nil:
		return nil, errors.New("must not hold credentials: name the key's variable in api_key_env")
	case u.RawQuery != "" || u.Fragment != "":
		return nil, errors.New("must not have a query or fragment")
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawPath = ""
	return u, nil
}

// notHeaderChar: r is not a letter, digit or '-', which header names are
// made of in practice.
func notHeaderChar(r rune) bool {
	return r != '-' && (r < '0' || r > '9') && (r < 'a' || r > 'z') && (r < 'A' || r > 'Z')
}

// parsePrefix parses a CIDR or a single address.
func parsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
}
