// Package deploytest keeps the files under deploy/ honest: they parse, they
// reference only metrics the Go code registers, they set only QF_*
// variables the services read, and Prometheus accepts the scrape config.
// It reads files only (no servers), so it stays fast.
package deploytest

import (
	"bytes"
	"encoding/json"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"quotaflow/internal/e2e"
)

const (
	repoRoot  = "../.."
	deployDir = ".."
)

var services = []string{"admission", "accounter", "alerter"}

// yamlFiles lists every YAML file under deploy/ (slash paths relative to deploy/).
func yamlFiles(t *testing.T) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(deployDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != deployDir && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if !d.IsDir() && (strings.HasSuffix(p, ".yaml") || strings.HasSuffix(p, ".yml")) {
			rel, _ := filepath.Rel(deployDir, p)
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// decodeAll parses every document of a YAML file.
func decodeAll(t *testing.T, rel string) []*yaml.Node {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, rel))
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	var docs []*yaml.Node
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", rel, len(docs)+1, err)
		}
		docs = append(docs, &n)
	}
	if len(docs) == 0 {
		t.Fatalf("%s: no YAML document", rel)
	}
	return docs
}

func decodeInto(t *testing.T, n *yaml.Node, v any) {
	t.Helper()
	if err := n.Decode(v); err != nil {
		t.Fatal(err)
	}
}

func TestYAMLParses(t *testing.T) {
	files := yamlFiles(t)
	for _, want := range []string{
		"docker-compose.yml", "policy.yaml", "webhooks.example.yaml",
		"prometheus/prometheus.yml", "prometheus/rules.yml",
		"grafana/provisioning/datasources/prometheus.yaml",
		"grafana/provisioning/dashboards/quotaflow.yaml",
	} {
		if !slices.Contains(files, want) {
			t.Errorf("deploy/%s is missing", want)
		}
	}
	for _, f := range files {
		for i, d := range decodeAll(t, f) {
			if strings.HasPrefix(f, "k8s/") {
				var m struct {
					APIVersion string `yaml:"apiVersion"`
					Kind       string `yaml:"kind"`
					Metadata   struct{ Name, Namespace string }
				}
				decodeInto(t, d, &m)
				if m.APIVersion == "" || m.Kind == "" || m.Metadata.Name == "" {
					t.Errorf("%s: document %d lacks apiVersion, kind or metadata.name", f, i+1)
				}
				if m.Kind != "Namespace" && m.Metadata.Namespace != "quotaflow" {
					t.Errorf("%s: %s/%s not in namespace quotaflow", f, m.Kind, m.Metadata.Name)
				}
			}
		}
	}
}

// definedMetrics returns the metric names the Go code registers: each
// Prometheus *Opts literal of a non-test .go file, joined from Namespace,
// Subsystem and Name the way prometheus.BuildFQName does.
func definedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	opts := regexp.MustCompile(`\b(?:Counter|Gauge|Histogram|Summary|Untyped)Opts\{`)
	field := func(name string) *regexp.Regexp {
		return regexp.MustCompile(`\b` + name + `:\s*"([a-zA-Z0-9_:]*)"`)
	}
	ns, sub, nm := field("Namespace"), field("Subsystem"), field("Name")
	defined := map[string]bool{}
	err := filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			n := d.Name()
			if p != repoRoot && (strings.HasPrefix(n, ".") || strings.HasPrefix(n, "_") || n == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		src := string(b)
		locs := opts.FindAllStringIndex(src, -1)
		for i, l := range locs {
			end := len(src)
			if i+1 < len(locs) {
				end = locs[i+1][0]
			}
			body := src[l[1]:end]
			get := func(re *regexp.Regexp) string {
				if m := re.FindStringSubmatch(body); m != nil {
					return m[1]
				}
				return ""
			}
			var parts []string
			for _, s := range []string{get(ns), get(sub), get(nm)} {
				if s != "" {
					parts = append(parts, s)
				}
			}
			if name := strings.Join(parts, "_"); strings.HasPrefix(name, "quotaflow_") {
				defined[name] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(defined) < 10 {
		t.Fatalf("found only %d quotaflow_ metrics in the Go code: the scanner is broken", len(defined))
	}
	return defined
}

var metricRef = regexp.MustCompile(`\bquotaflow_[a-z0-9_]+`)

// known reports whether ref is a defined metric or one of a histogram's series.
func known(defined map[string]bool, ref string) bool {
	if defined[ref] {
		return true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(ref, suf); ok && defined[base] {
			return true
		}
	}
	return false
}

func TestMetricNamesExist(t *testing.T) {
	defined := definedMetrics(t)
	names := make([]string, 0, len(defined))
	for n := range defined {
		names = append(names, n)
	}
	sort.Strings(names)
	t.Logf("metrics registered by the Go code: %s", strings.Join(names, " "))

	files := []string{"grafana/quotaflow-dashboard.json", "k8s/README.md"}
	for _, f := range yamlFiles(t) {
		if strings.HasPrefix(f, "prometheus/") || strings.HasPrefix(f, "k8s/") ||
			strings.HasPrefix(f, "grafana/") || f == "docker-compose.yml" {
			files = append(files, f)
		}
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(deployDir, f))
		if err != nil {
			t.Fatal(err)
		}
		for _, ref := range metricRef.FindAllString(string(b), -1) {
			if !known(defined, ref) {
				t.Errorf("deploy/%s references %s, which no Go code registers", f, ref)
			}
		}
	}
}

func TestDashboard(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(deployDir, "grafana/quotaflow-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Title  string `json:"title"`
		Panels []struct {
			ID      int    `json:"id"`
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	if d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		t.Fatal("dashboard lacks uid, title or panels")
	}
	var exprs strings.Builder
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.Count(tg.Expr, "(") != strings.Count(tg.Expr, ")") {
				t.Errorf("panel %q: unbalanced parentheses in %s", p.Title, tg.Expr)
			}
			exprs.WriteString(tg.Expr + "\n")
		}
	}
	// The panels issue 6 asks for.
	for _, want := range []string{
		"quotaflow_admission_decisions_total",
		`result="denied"`,
		`result="failopen"`,
		"by (scope)",
		"by (endpoint)",
		"histogram_quantile(0.99, sum by (le, route) (rate(quotaflow_admission_request_duration_seconds_bucket",
		"quotaflow_accounter_lag_seconds",
		"sum by (type, result) (rate(quotaflow_accounter_events_total[5m]))",
		"by (kind) (increase(quotaflow_alerts_total",
		"by (result) (increase(quotaflow_webhook_deliveries_total",
		"quotaflow_admission_outbox_queue_depth",
		"quotaflow_admission_breaker_state",
		"max by (tenant, limit) (quotaflow_alerter_top_tenant_tokens_used)",
		"min by (tenant, limit) (quotaflow_alerter_top_tenant_tokens_remaining)",
	} {
		if !strings.Contains(exprs.String(), want) {
			t.Errorf("no dashboard query contains %s", want)
		}
	}
}

// readVars returns the QF_ variables each service reads, as envconfig
// does: the envconfig tags of services/<svc>/config.go's Config and, in
// turn, of every struct it embeds (config.NATS embeds stream.Config;
// obs.Ops, auth.Tokens, llmproxy.Settings, ...), found by parsing the Go
// source of the embedded type's package.
func readVars(t *testing.T) map[string]map[string]bool {
	t.Helper()
	out := map[string]map[string]bool{"any": {}}
	for _, svc := range services {
		out[svc] = map[string]bool{}
		structVars(t, out[svc], filepath.Join(repoRoot, "services", svc), "Config")
		maps.Copy(out["any"], out[svc])
	}
	for svc, wants := range map[string][]string{
		"admission": {"QF_REDIS_URL", "QF_STREAM", "QF_PPROF", "QF_ADMISSION_ADDR", "QF_API_TOKENS", "QF_GATEWAY_ADDR"},
		"accounter": {"QF_POSTGRES_URL", "QF_ACK_WAIT", "QF_CONSOLE_ADDR", "QF_API_TOKENS_FILE"},
		"alerter":   {"QF_WEBHOOKS_FILE", "QF_LOG_LEVEL"},
	} {
		for _, want := range wants {
			if !out[svc][want] {
				t.Fatalf("%s reads %d variables, not %s: the scanner is broken", svc, len(out[svc]), want)
			}
		}
	}
	if out["alerter"]["QF_REDIS_URL"] || out["alerter"]["QF_CONSOLE_ADDR"] {
		t.Fatal("the alerter reads QF_REDIS_URL or QF_CONSOLE_ADDR: the scanner is broken")
	}
	return out
}

// structVars adds to vars the QF_ variables of struct typ, declared in the
// non-test Go files of dir, and of the structs it embeds.
func structVars(t *testing.T, vars map[string]bool, dir, typ string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range files {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, s := range gd.Specs {
				ts := s.(*ast.TypeSpec)
				st, ok := ts.Type.(*ast.StructType)
				if !ok || ts.Name.Name != typ {
					continue
				}
				for _, fld := range st.Fields.List {
					if fld.Tag != nil {
						tag, _ := strconv.Unquote(fld.Tag.Value)
						if name := reflect.StructTag(tag).Get("envconfig"); name != "" {
							vars["QF_"+name] = true
						}
					}
					if len(fld.Names) == 0 {
						embedDir, embedTyp := embedded(t, f, dir, fld.Type)
						structVars(t, vars, embedDir, embedTyp)
					}
				}
				return
			}
		}
	}
	t.Fatalf("%s declares no struct %s: update this test", dir, typ)
}

// embedded returns the directory and name of an embedded struct type: one
// of dir's package or of a quotaflow package that file f imports.
func embedded(t *testing.T, f *ast.File, dir string, typ ast.Expr) (string, string) {
	t.Helper()
	switch e := typ.(type) {
	case *ast.Ident:
		return dir, e.Name
	case *ast.SelectorExpr:
		if pkg, ok := e.X.(*ast.Ident); ok {
			for _, imp := range f.Imports {
				p, _ := strconv.Unquote(imp.Path.Value)
				if imp.Name != nil && imp.Name.Name == pkg.Name || imp.Name == nil && path.Base(p) == pkg.Name {
					rel, ok := strings.CutPrefix(p, "quotaflow/")
					if !ok {
						t.Fatalf("%s embeds %s.%s from outside quotaflow: update this test", dir, pkg.Name, e.Sel.Name)
					}
					return filepath.Join(repoRoot, rel), e.Sel.Name
				}
			}
		}
	}
	t.Fatalf("%s embeds %s, which this test cannot follow: update it", dir, types.ExprString(typ))
	return "", ""
}

func checkVars(t *testing.T, where string, reads map[string]bool, env map[string]string) {
	t.Helper()
	for k := range env {
		if strings.HasPrefix(k, "QF_") && !reads[k] {
			t.Errorf("%s sets %s, which it does not read", where, k)
		}
	}
}

func TestComposeEnv(t *testing.T) {
	vars := readVars(t)
	var c struct {
		Services map[string]struct {
			Image       string
			Command     []string
			Environment map[string]string
			Ports       []string
			Healthcheck *struct{ Test []string }
			DependsOn   yaml.Node `yaml:"depends_on"`
		}
	}
	decodeInto(t, decodeAll(t, "docker-compose.yml")[0], &c)
	for _, want := range []string{"redis", "postgres", "nats", "admission", "accounter", "alerter", "prometheus", "grafana"} {
		if _, ok := c.Services[want]; !ok {
			t.Errorf("docker-compose.yml has no service %s", want)
		}
	}
	for name, s := range c.Services {
		for _, p := range s.Ports {
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("compose %s publishes %q beyond loopback", name, p)
			}
		}
	}
	for _, svc := range services {
		s := c.Services[svc]
		if len(s.Command) == 0 || s.Command[0] != svc {
			t.Errorf("compose %s: command %v, want [%s]", svc, s.Command, svc)
		}
		checkVars(t, "compose "+svc, vars[svc], s.Environment)
		if s.Healthcheck == nil || !strings.Contains(strings.Join(s.Healthcheck.Test, " "), "/readyz") {
			t.Errorf("compose %s: no /readyz healthcheck", svc)
		}
		if s.DependsOn.Kind != yaml.MappingNode {
			t.Errorf("compose %s: depends_on should be a map with conditions", svc)
		}
	}
	// Without a token the console listens on the container's loopback, out
	// of reach of its published port.
	if a, b := c.Services["accounter"].Environment["QF_API_TOKENS"], c.Services["admission"].Environment["QF_API_TOKENS"]; a != b {
		t.Errorf("compose accounter: QF_API_TOKENS %q, not admission's %q (its console authenticates with them)", a, b)
	}
}

// TestK8sEnv checks the Deployments (service, env, probes, resources,
// non-root, replicas) and the QF_ keys of the ConfigMaps and Secrets.
func TestK8sEnv(t *testing.T) {
	vars := readVars(t)
	files, err := filepath.Glob(filepath.Join(deployDir, "k8s/*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy, err := os.ReadFile(filepath.Join(deployDir, "policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	deployments := map[string]int{}
	var pdb bool
	for _, f := range files {
		rel, _ := filepath.Rel(deployDir, f)
		for _, d := range decodeAll(t, filepath.ToSlash(rel)) {
			var o struct {
				Kind     string
				Metadata struct{ Name string }
				Data     map[string]string
				Strdata  map[string]string `yaml:"stringData"`
				Spec     struct {
					Replicas int
					Template struct {
						Spec struct {
							SecurityContext struct {
								RunAsNonRoot bool `yaml:"runAsNonRoot"`
							} `yaml:"securityContext"`
							Volumes []struct {
								Name   string
								Secret struct {
									SecretName string `yaml:"secretName"`
									Items      []struct{ Key, Path string }
								}
							}
							Containers []struct {
								Args    []string
								Command []string
								Env     []struct{ Name, Value string }
								Mounts  []struct {
									Name      string
									MountPath string `yaml:"mountPath"`
								} `yaml:"volumeMounts"`
								Probe map[string]any `yaml:"readinessProbe"`
								Live  map[string]any `yaml:"livenessProbe"`
								Res   struct {
									Requests, Limits map[string]string
								} `yaml:"resources"`
							}
						}
					}
				}
			}
			decodeInto(t, d, &o)
			switch o.Kind {
			case "ConfigMap", "Secret":
				kv := map[string]string{}
				for k, v := range o.Data {
					kv[k] = v
				}
				for k, v := range o.Strdata {
					kv[k] = v
				}
				checkVars(t, o.Kind+" "+o.Metadata.Name, vars["any"], kv)
				if p, ok := kv["policy.yaml"]; ok && p != string(policy) {
					t.Errorf("ConfigMap %s: policy.yaml differs from deploy/policy.yaml; copy it again", o.Metadata.Name)
				}
			case "PodDisruptionBudget":
				pdb = true
			case "Deployment":
				ts := o.Spec.Template.Spec
				if !ts.SecurityContext.RunAsNonRoot {
					t.Errorf("Deployment %s: no runAsNonRoot", o.Metadata.Name)
				}
				for _, c := range ts.Containers {
					args := append(c.Command, c.Args...)
					if len(args) == 0 || !slices.Contains(services, args[0]) {
						t.Errorf("Deployment %s: container runs %v, not a quotaflow service", o.Metadata.Name, args)
						continue
					}
					svc := args[0]
					deployments[svc] = o.Spec.Replicas
					env := map[string]string{}
					for _, e := range c.Env {
						env[e.Name] = e.Value
					}
					checkVars(t, "Deployment "+o.Metadata.Name, vars[svc], env)
					if c.Probe == nil || c.Live == nil {
						t.Errorf("Deployment %s: readiness or liveness probe missing", o.Metadata.Name)
					}
					if len(c.Res.Requests) == 0 || len(c.Res.Limits) == 0 {
						t.Errorf("Deployment %s: resource requests or limits missing", o.Metadata.Name)
					}
					// A service that takes QF_API_TOKENS takes the file too:
					// the Secret's rotated and tenant-bound tokens are there.
					if _, ok := env["QF_API_TOKENS"]; ok {
						file := env["QF_API_TOKENS_FILE"]
						var mounted bool
						for _, m := range c.Mounts {
							for _, v := range ts.Volumes {
								if v.Name == m.Name && path.Dir(file) == m.MountPath && v.Secret.SecretName == "quotaflow-secrets" &&
									slices.Contains(v.Secret.Items, struct{ Key, Path string }{"api-tokens.yaml", path.Base(file)}) {
									mounted = true
								}
							}
						}
						if !mounted {
							t.Errorf("Deployment %s: QF_API_TOKENS without QF_API_TOKENS_FILE %q mounted from the Secret's api-tokens.yaml", o.Metadata.Name, file)
						}
					}
					if svc == "admission" && env["QF_INSTANCES"] != strconv.Itoa(o.Spec.Replicas) {
						t.Errorf("Deployment admission: QF_INSTANCES %q but replicas %d", env["QF_INSTANCES"], o.Spec.Replicas)
					}
				}
			}
		}
	}
	for _, svc := range services {
		if _, ok := deployments[svc]; !ok {
			t.Errorf("no Deployment runs %s", svc)
		}
	}
	if deployments["admission"] < 2 {
		t.Errorf("admission has %d replicas, want 2 or more", deployments["admission"])
	}
	if deployments["alerter"] != 1 {
		t.Errorf("alerter has %d replicas, want 1 (its spike/abuse counters are in memory)", deployments["alerter"])
	}
	if !pdb {
		t.Error("no PodDisruptionBudget")
	}
}

func TestDockerfileEnv(t *testing.T) {
	vars := readVars(t)
	b, err := os.ReadFile(filepath.Join(deployDir, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	src := string(b)
	for _, m := range regexp.MustCompile(`\b(QF_[A-Z0-9_]+)=`).FindAllStringSubmatch(src, -1) {
		if !vars["any"][m[1]] {
			t.Errorf("Dockerfile sets %s, which no service reads", m[1])
		}
	}
	for _, svc := range services {
		if !strings.Contains(src, "./services/"+svc) {
			t.Errorf("Dockerfile does not build ./services/%s", svc)
		}
	}
	if !regexp.MustCompile(`(?m)^USER\s+\S+`).MatchString(src) || regexp.MustCompile(`(?m)^USER\s+(root|0)\b`).MatchString(src) {
		t.Error("Dockerfile does not switch to a non-root USER")
	}
}

// TestPromtoolCheckConfig checks deploy/prometheus/prometheus.yml with
// Prometheus's own promtool, installed when missing (e2e.EnsureTool).
func TestPromtoolCheckConfig(t *testing.T) {
	promtool := e2e.EnsureTool(t, "promtool")
	// rule_files are relative to the config's directory.
	cmd := exec.Command(promtool, "check", "config", "prometheus.yml")
	cmd.Dir = filepath.Join(deployDir, "prometheus")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check config: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}
