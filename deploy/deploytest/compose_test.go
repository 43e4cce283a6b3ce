package deploytest

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redisconn"
)

// TestComposeCluster checks docker-compose.cluster.yml, merged over
// docker-compose.yml: every QF_ variable is read by the service it sets it
// for, the admission instances are as many as QF_INSTANCES says, the
// accounters share the base file's durable, Redis is a cluster of the
// file's own nodes, and NATS is three of the stack's nodes with R3 streams.
func TestComposeCluster(t *testing.T) {
	vars := readVars(t)
	type service struct {
		Image       string
		Environment map[string]string
		Ports       []string
		Extends     struct{ Service, File string }
		Command     []string
	}
	var base, over struct{ Services map[string]service }
	decodeInto(t, decodeAll(t, "docker-compose.yml")[0], &base)
	decodeInto(t, decodeAll(t, "docker-compose.cluster.yml")[0], &over)

	// env merges a service's environment as compose does: the base file's
	// (or the extended service's), then the override's.
	env := func(name string) (string, map[string]string) {
		svc, s := name, over.Services[name]
		if s.Extends.Service != "" {
			if s.Extends.File != "docker-compose.yml" {
				t.Fatalf("compose cluster %s extends %s of %q, want docker-compose.yml", name, s.Extends.Service, s.Extends.File)
			}
			svc = s.Extends.Service
		}
		merged := map[string]string{}
		maps.Copy(merged, base.Services[svc].Environment)
		maps.Copy(merged, s.Environment)
		return svc, merged
	}
	instances := map[string][]map[string]string{}
	for name, s := range over.Services {
		for _, p := range s.Ports {
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("compose cluster %s publishes %q beyond loopback", name, p)
			}
		}
		svc, e := env(name)
		if slices.Contains(services, svc) {
			checkVars(t, "compose cluster "+name, vars[svc], e)
			instances[svc] = append(instances[svc], e)
		} else if len(s.Environment) > 0 {
			t.Errorf("compose cluster %s sets an environment but runs no quotaflow service", name)
		}
	}
	for _, svc := range services {
		if len(instances[svc]) == 0 {
			t.Fatalf("compose cluster: no %s", svc)
		}
	}
	if n := len(instances["admission"]); n < 2 {
		t.Errorf("compose cluster: %d admission instances, want 2 or more", n)
	}
	if n := len(instances["accounter"]); n < 2 {
		t.Errorf("compose cluster: %d accounter instances, want 2 or more", n)
	}
	for _, e := range instances["admission"] {
		if e["QF_INSTANCES"] != strconv.Itoa(len(instances["admission"])) {
			t.Errorf("compose cluster admission: QF_INSTANCES %q with %d instances", e["QF_INSTANCES"], len(instances["admission"]))
		}
	}
	for _, e := range instances["accounter"] {
		if e["QF_DURABLE"] == "" || e["QF_DURABLE"] != instances["accounter"][0]["QF_DURABLE"] {
			t.Errorf("compose cluster accounter: durable %q, want one named durable for all", e["QF_DURABLE"])
		}
	}
	host := func(addr string) string { return strings.Split(addr, ":")[0] }
	for _, svc := range services {
		for _, e := range instances[svc] {
			if svc != "alerter" {
				c, err := redisconn.Open(e["QF_REDIS_URL"])
				if err != nil {
					t.Fatalf("compose cluster %s QF_REDIS_URL: %v", svc, err)
				}
				cc, ok := c.(*redis.ClusterClient)
				if !ok {
					t.Fatalf("compose cluster %s QF_REDIS_URL opens a %T, want a cluster client", svc, c)
				}
				for _, a := range cc.Options().Addrs {
					if s, ok := over.Services[host(a)]; !ok || !slices.Contains(s.Command, "--cluster-enabled") {
						t.Errorf("compose cluster %s: Redis seed %s is no cluster node of the file", svc, a)
					}
				}
				if len(cc.Options().Addrs) != 3 {
					t.Errorf("compose cluster %s: Redis seeds %v, want the 3 nodes", svc, cc.Options().Addrs)
				}
				c.Close()
			}
			if e["QF_STREAM_REPLICAS"] != "3" {
				t.Errorf("compose cluster %s: QF_STREAM_REPLICAS %q, want 3", svc, e["QF_STREAM_REPLICAS"])
			}
			urls := strings.Split(e["QF_NATS_URL"], ",")
			for _, u := range urls {
				h := host(strings.TrimPrefix(u, "nats://"))
				if _, ok := over.Services[h]; !ok {
					t.Errorf("compose cluster %s: NATS server %s is no node of the cluster file", svc, u)
				}
			}
			if len(urls) != 3 {
				t.Errorf("compose cluster %s: NATS URLs %v, want the 3 nodes", svc, urls)
			}
		}
	}
}
