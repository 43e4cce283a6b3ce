package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"quotaflow/services/admission/internal/httpapi"
)

// TestNginxAuthRequest runs real nginx with deploy/gateways/nginx/quotaflow.conf in
// front of a tiny upstream and admission: a client gets 200s, then a 429
// with Retry-After and the rate-limit headers, through nginx. nginx is
// installed (Debian package) by deploy/gateways/ensure.sh when missing;
// the test skips only when that is impossible here (no apt-get or no root),
// and never in CI.
func TestNginxAuthRequest(t *testing.T) {
	nginx, g := newGatewayRig(t, "nginx", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s/%s request %s\n", r.Header.Get("X-Quota-Tenant"), r.Header.Get("X-Quota-User"), r.Header.Get("X-Request-Id"))
	}, func(o *httpapi.Options) { o.AuthzDenyStatus = http.StatusForbidden })
	s, addr := g.s, g.addr
	text := gatewayConfig(t, filepath.Join("nginx", "quotaflow.conf"), map[string]string{
		"server 127.0.0.1:8080;":     "server " + strings.TrimPrefix(s.srv.URL, "http://") + ";",
		"server 127.0.0.1:3000;":     "server " + strings.TrimPrefix(g.upstream.URL, "http://") + ";",
		"listen 127.0.0.1:8000;":     "listen " + addr + ";",
		"CHANGE-ME-admission-token":  "nginx-token",
		`"key-acme-alice"   "acme";`: `"key-acme-alice"   "` + s.tenant + `";`,
		`"key-acme-bob"     "acme";`: `"key-acme-bob"     "` + s.tenant + `";`,
	})
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "quotaflow.conf"), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	user := ""
	if os.Geteuid() == 0 {
		user = "user root;" // workers may then read the test's private temp dir
	}
	mainConf := fmt.Sprintf(`%s
worker_processes 1;
pid %[2]s/nginx.pid;
error_log %[2]s/error.log info;
events { worker_connections 64; }
http {
    log_format qf "$uri rid=$request_id status=$status"; log_subrequest on;
    access_log %[2]s/access.log qf;
    client_body_temp_path %[2]s/body;
    proxy_temp_path %[2]s/proxy;
    fastcgi_temp_path %[2]s/fastcgi;
    uwsgi_temp_path %[2]s/uwsgi;
    scgi_temp_path %[2]s/scgi;
    include %[2]s/quotaflow.conf;
}
`, user, dir)
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(mainConf), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(nginx, "-t", "-p", dir, "-c", filepath.Join(dir, "nginx.conf")).CombinedOutput(); err != nil {
		t.Fatalf("nginx -t: %v\n%s", err, out)
	}
	runGateway(t, dir, addr, exec.Command(nginx, "-p", dir, "-c", filepath.Join(dir, "nginx.conf"), "-g", "daemon off;"),
		"access.log", "error.log")
	base := "http://" + addr

	if resp, _ := g.post(t, ""); resp.StatusCode != 401 {
		t.Errorf("no API key: %d, want 401 from nginx", resp.StatusCode)
	}
	// A URI admission cannot check (an escaped control character in the
	// endpoint; nginx itself refuses an escaped NUL with a 400) is a
	// denial the client sees as a 429, not a 400 that nginx makes a 500.
	// It spends none of alice's allowance.
	req, _ := http.NewRequest("GET", base+"/api/v1/gen%01erate", nil)
	req.Header.Set("X-Api-Key", "key-acme-alice")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	} else {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "" {
			t.Errorf("escaped control character in the URI: %d %v %q, want 429 without Retry-After", resp.StatusCode, resp.Header, b)
		}
	}
	for i := range 3 {
		// A client-sent X-Quota-* header is overwritten by nginx.
		resp, body := g.post(t, "key-acme-alice", "X-Quota-Tenant", "someone-else", "X-Quota-Estimated-Tokens", "0")
		if resp.StatusCode != 200 || !strings.HasPrefix(body, "hello "+s.tenant+"/alice") {
			t.Fatalf("request %d: %d %q, want 200 from the upstream", i, resp.StatusCode, body)
		}
		if resp.Header.Get("RateLimit") == "" || resp.Header.Get("RateLimit-Policy") == "" ||
			resp.Header.Get("X-RateLimit-Remaining") != fmt.Sprint(2-i) {
			t.Errorf("request %d: headers %v", i, resp.Header)
		}
	}
	// The upstream saw the request id admission reserved under: it can
	// release (or report) that reservation.
	_, body := g.post(t, "key-acme-bob")
	id := body[strings.LastIndex(body, " ")+1 : len(body)-1]
	rel := s.call("POST", "/v1/release", `{"tenant":"`+s.tenant+`","user":"bob","request_id":"`+id+`"}`,
		"Authorization", "Bearer nginx-token")
	if rel.code != 200 || rel.body["status"] != "released" {
		t.Errorf("release of the upstream's X-Request-Id %q = %d %v, want released", id, rel.code, rel.body)
	}

	resp, body := g.post(t, "key-acme-alice")
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("4th request: %d %q, want 429", resp.StatusCode, body)
	}
	checkGatewayDenial(t, resp, body)
	// Another user of the tenant is not affected.
	if resp, body := g.post(t, "key-acme-bob"); resp.StatusCode != 200 {
		t.Errorf("bob: %d %q, want 200", resp.StatusCode, body)
	}
}
