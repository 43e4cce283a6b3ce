// Package redisconn turns a QF_REDIS_URL into a redis.UniversalClient: one
// node, a Sentinel-monitored master or a Redis Cluster, chosen by the URL.
package redisconn

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Open parses rawURL and returns a client of the Redis it names:
//
//   - redis://[user:password@]host:port/db?opts — one node (redis.ParseURL);
//   - ...?master_name=NAME&addr=host:port... — a Sentinel failover client; the
//     URL's host and each addr are sentinels (redis.ParseFailoverURL);
//   - ...?cluster=true or with addr=host:port parameters — a Redis Cluster
//     client; the host and each addr are seed nodes (redis.ParseClusterURL).
//
// rediss:// enables TLS. Other query parameters are go-redis options
// (dial_timeout=3s, pool_size=20, ...). Every client has
// ContextTimeoutEnabled set, so a context deadline (admission's few
// milliseconds per call) bounds the socket wait too, not only go-redis's own
// read timeout. A Cluster client is NewCluster's. Errors never contain the
// URL, since it may hold a password.
func Open(rawURL string) (redis.UniversalClient, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("redis url: cannot parse it")
	}
	q := u.Query()
	cluster := false
	if v := q.Get("cluster"); v != "" {
		cluster, err = strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("redis url: cluster=%q is not a boolean", v)
		}
		q.Del("cluster")
		u.RawQuery = q.Encode()
	}
	switch {
	case q.Has("master_name"):
		o, err := redis.ParseFailoverURL(u.String())
		if err != nil {
			return nil, fmt.Errorf("redis url (sentinel): %w", redact(err, u))
		}
		o.ContextTimeoutEnabled = true
		return redis.NewFailoverClient(o), nil
	case cluster || q.Has("addr"):
		o, err := redis.ParseClusterURL(u.String())
		if err != nil {
			return nil, fmt.Errorf("redis url (cluster): %w", redact(err, u))
		}
		return NewCluster(o), nil
	default:
		o, err := redis.ParseURL(u.String())
		if err != nil {
			return nil, fmt.Errorf("redis url: %w", redact(err, u))
		}
		o.ContextTimeoutEnabled = true
		return redis.NewClient(o), nil
	}
}

// redact drops the error text if it would repeat the password.
func redact(err error, u *url.URL) error {
	if p, ok := u.User.Password(); ok && p != "" {
		if strings.Contains(err.Error(), p) {
			return fmt.Errorf("invalid url (details hidden: they contain the password)")
		}
	}
	return err
}

// NewCluster returns a Cluster client of o with ContextTimeoutEnabled set
// and go-redis's retries off (MaxRedirects -1): it sends a command once and
// follows no MOVED or ASK. go-redis retries a pipeline whose first reply is
// a refusal (TRYAGAIN while a slot moves), and when ctx ends in its pause
// it overwrites every reply with ctx's error, so a reserve that ran on a
// healthy master read as failed. The limits engine's runner sends refused
// calls again itself, each command keeping its own reply.
//
// It reloads the cluster's layout every second unless o sets an interval:
// a master that died answers no MOVED, so at go-redis's default of 60 s its
// slots went on being sent to it, and failing, for up to a minute after its
// replica took over.
func NewCluster(o *redis.ClusterOptions) *redis.ClusterClient {
	o.ContextTimeoutEnabled = true
	o.MaxRedirects = -1
	if o.ClusterStateReloadInterval == 0 {
		o.ClusterStateReloadInterval = time.Second
	}
	return redis.NewClusterClient(o)
}
