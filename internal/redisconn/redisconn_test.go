package redisconn

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestOpen(t *testing.T) {
	for _, tc := range []struct {
		url  string
		kind string
	}{
		{"redis://127.0.0.1:6379/0", "*redis.Client"},
		{"rediss://user:pw@cache.example:6380/2?pool_size=5", "*redis.Client"},
		{"redis://127.0.0.1:7000?addr=127.0.0.1:7001&addr=127.0.0.1:7002", "*redis.ClusterClient"},
		{"redis://127.0.0.1:7000?cluster=true", "*redis.ClusterClient"},
		{"redis://127.0.0.1:26379?master_name=mymaster&addr=127.0.0.1:26380", "*redis.Client"}, // failover clients are *redis.Client
	} {
		c, err := Open(tc.url)
		if err != nil {
			t.Errorf("Open(%q) = %v", tc.url, err)
			continue
		}
		var kind string
		switch c.(type) {
		case *redis.Client:
			kind = "*redis.Client"
		case *redis.ClusterClient:
			kind = "*redis.ClusterClient"
		}
		if kind != tc.kind {
			t.Errorf("Open(%q) = %T, want %s", tc.url, c, tc.kind)
		}
		c.Close()
	}
	for _, bad := range []string{"redis://h:1?cluster=maybe", "redis://:hunter2@h:1/0?bogus_option=1", "::"} {
		_, err := Open(bad)
		if err == nil {
			t.Errorf("Open(%q) = nil error", bad)
		} else if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("Open error %q contains the password", err)
		}
	}
}
