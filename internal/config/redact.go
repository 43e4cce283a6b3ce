package config

import (
	"net/url"
	"strings"
)

// Redacted returns rawURL for logs, its secrets replaced by "xxxxx": the
// password, a NATS token (a user name without a password) and query
// parameters named like a password, secret or token. Each URL of a
// comma-separated list (NATS accepts one) is redacted; what does not parse
// as a URL, such as a key=value DSN, is not shown at all.
func Redacted(rawURL string) string {
	parts := strings.Split(rawURL, ",")
	for i, p := range parts {
		parts[i] = redactOne(strings.TrimSpace(p))
	}
	return strings.Join(parts, ",")
}

const mask = "xxxxx"

func redactOne(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme == "" || u.Opaque != "" {
		return "(not a url)"
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), mask)
		} else if natsScheme[u.Scheme] && u.User.Username() != "" {
			u.User = url.User(mask)
		}
	}
	q, changed := u.Query(), false
	for k := range q {
		if secretParam(k) {
			q[k], changed = []string{mask}, true
		}
	}
	if changed {
		u.RawQuery = q.Encode()
	}
	return u.String()
}

// natsScheme are the schemes of NATS URLs, where a user name alone is a
// token.
var natsScheme = map[string]bool{"nats": true, "tls": true, "ws": true, "wss": true}

func secretParam(name string) bool {
	n := strings.ToLower(name)
	return strings.Contains(n, "password") || strings.Contains(n, "secret") || strings.Contains(n, "token")
}
