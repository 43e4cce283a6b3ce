// Package deliver sends queued alerts to webhooks: it loads the endpoints
// (QF_WEBHOOKS_FILE), routes alerts to them by kind and tenant, signs each
// request per the Standard Webhooks specification and retries from the
// Postgres outbox with exponential backoff and jitter until delivered or
// too old (dead). Destinations on loopback, private or link-local
// addresses are refused at dial time unless the endpoint allows them.
package deliver

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"quotaflow/pkg/ident"
)

// SecretPrefix starts every webhook secret; the rest is base64.
const SecretPrefix = "whsec_"

// Webhook is one endpoint of QF_WEBHOOKS_FILE.
type Webhook struct {
	// Name identifies the endpoint in the outbox and in logs; unique.
	Name string `yaml:"name"`
	// URL is the http or https address alerts are POSTed to.
	URL string `yaml:"url"`
	// Secret is "whsec_" and the base64 of the signing key. It is never
	// logged.
	Secret string `yaml:"secret"`
	// Kinds are the alert kinds sent here; empty means all.
	Kinds []string `yaml:"kinds"`
	// Tenants are the tenants whose alerts are sent here; empty means all.
	// Alerts without a tenant (an endpoint's spike, an IP's burst) go only
	// to endpoints without a tenant filter; so an empty id is refused, as
	// is one ident.Check refuses.
	Tenants []string `yaml:"tenants"`
	// MinThreshold drops the quota.threshold alerts of a lower percentage
	// (1 to 100; 0 sends every one): min_threshold: 90 sends 90 and 100,
	// not 80.
	MinThreshold int `yaml:"min_threshold"`
	// AllowPrivate permits loopback, private and link-local destinations
	// (tests, on-premises receivers).
	AllowPrivate bool `yaml:"allow_private"`
}

// String describes w without its secret.
func (w Webhook) String() string { return fmt.Sprintf("webhook %s", w.Name) }

// Wants reports whether w takes alerts of kind for tenant; threshold is
// the percentage a threshold alert crossed, 0 for other kinds.
func (w Webhook) Wants(kind, tenant string, threshold int) bool {
	if len(w.Kinds) > 0 && !slices.Contains(w.Kinds, kind) {
		return false
	}
	if threshold > 0 && threshold < w.MinThreshold {
		return false
	}
	return len(w.Tenants) == 0 || slices.Contains(w.Tenants, tenant)
}

// File is the shape of QF_WEBHOOKS_FILE.
type File struct {
	Webhooks []Webhook `yaml:"webhooks"`
}

// Load reads and validates the webhooks file at path. Unknown fields are
// errors. An empty path means no webhooks. Errors never contain a secret.
func Load(path string, kinds []string) ([]Webhook, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("webhooks file: %w", err)
	}
	return Parse(b, kinds)
}

// Parse reads and validates a webhooks file's content; kinds are the
// alert kinds a webhook may name.
func Parse(b []byte, kinds []string) ([]Webhook, error) {
	var f File
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) { // empty file: no webhooks
		return nil, fmt.Errorf("webhooks file: %w", err)
	}
	var errs []error
	seen := map[string]bool{}
	for i, w := range f.Webhooks {
		at := fmt.Sprintf("webhooks[%d]", i)
		if w.Name == "" {
			errs = append(errs, fmt.Errorf("%s.name: required", at))
		} else if seen[w.Name] {
			errs = append(errs, fmt.Errorf("%s.name: %q appears twice", at, w.Name))
		}
		seen[w.Name] = true
		if u, err := url.Parse(w.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("%s.url: want an absolute http or https URL", at))
		} else if u.User != nil {
			errs = append(errs, fmt.Errorf("%s.url: must not carry credentials", at))
		}
		if _, err := DecodeSecret(w.Secret); err != nil {
			errs = append(errs, fmt.Errorf("%s.secret: %w", at, err))
		}
		if w.MinThreshold < 0 || w.MinThreshold > 100 {
			errs = append(errs, fmt.Errorf("%s.min_threshold: %d is not a percentage from 0 to 100", at, w.MinThreshold))
		}
		for j, tenant := range w.Tenants {
			err := ident.Check(tenant)
			if tenant == "" { // would take the alerts that have no tenant, meant for unfiltered webhooks
				err = errors.New("empty")
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.tenants[%d] of webhook %q: not a tenant id: %w", at, j, w.Name, err))
			}
		}
		for j, k := range w.Kinds {
			if !slices.Contains(kinds, k) {
				errs = append(errs, fmt.Errorf("%s.kinds[%d]: %q is not one of %s", at, j, k, strings.Join(kinds, ", ")))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("webhooks file: %w", err)
	}
	return f.Webhooks, nil
}

// DecodeSecret returns the key of a "whsec_<base64>" secret. Its error
// never contains the secret.
func DecodeSecret(s string) ([]byte, error) {
	rest, ok := strings.CutPrefix(s, SecretPrefix)
	if !ok {
		return nil, fmt.Errorf("want %s followed by base64", SecretPrefix)
	}
	key, err := base64.StdEncoding.DecodeString(rest)
	if err != nil || len(key) < 16 {
		return nil, errors.New("want base64 of at least 16 bytes after " + SecretPrefix)
	}
	return key, nil
}
