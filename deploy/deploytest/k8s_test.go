package deploytest

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"quotaflow/internal/redisconn"
)

// k8sDecoder decodes manifests into the k8s.io/api types of the kinds the
// manifests may use, strictly: an unknown or duplicated field is an error,
// and so is a kind outside this scheme. It stands in for a schema-fetching
// validator or an API server's dry run, which cannot work offline.
func k8sDecoder(t *testing.T) runtime.Decoder {
	t.Helper()
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme} {
		if err := add(s); err != nil {
			t.Fatal(err)
		}
	}
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
}

// k8sObjects strictly decodes every document of one manifest.
func k8sObjects(t *testing.T, dec runtime.Decoder, rel string, b []byte) []runtime.Object {
	t.Helper()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var out []runtime.Object
	for i := 1; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", rel, i, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Errorf("%s: document %d: %v", rel, i, err)
			continue
		}
		out = append(out, obj)
	}
	return out
}

// stripComments drops whole-line YAML comments (a document of comments only
// is no object).
func stripComments(doc []byte) []byte {
	var b bytes.Buffer
	for line := range strings.Lines(string(doc)) {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
		}
	}
	return b.Bytes()
}

// k8sManifests returns every strictly decoded object of deploy/k8s/*.yaml.
func k8sManifests(t *testing.T) []runtime.Object {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(deployDir, "k8s/*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests under deploy/k8s (%v)", err)
	}
	dec := k8sDecoder(t)
	var out []runtime.Object
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, k8sObjects(t, dec, filepath.Base(f), b)...)
	}
	return out
}

// TestK8sStrict decodes every manifest into its k8s.io/api type; the
// decoder itself is checked on the mistakes it must reject.
func TestK8sStrict(t *testing.T) {
	objs := k8sManifests(t)
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.GetObjectKind().GroupVersionKind().Kind]++
	}
	for kind, want := range map[string]int{"Namespace": 1, "ConfigMap": 2, "Secret": 1, "Deployment": 3, "Service": 5, "PodDisruptionBudget": 1} {
		if kinds[kind] != want {
			t.Errorf("%d objects of kind %s, want %d (all kinds: %v)", kinds[kind], kind, want, kinds)
		}
	}

	dec := k8sDecoder(t)
	for _, tc := range []struct{ name, doc, want string }{
		{"unknown field", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndatta: {a: b}\n", `unknown field "datta"`},
		{"nested unknown field", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n", `unknown field "spec.replica"`},
		{"duplicate field", "apiVersion: v1\nkind: Namespace\nmetadata: {name: one}\nmetadata: {name: two}\n", `"metadata"`},
		{"unknown kind", "apiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata: {name: x}\n", "no kind"},
		{"wrong type", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n", "replicas"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := dec.Decode([]byte(tc.doc), nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Decode(%s) = %v, want an error naming %s", tc.name, err, tc.want)
			}
		})
	}
}

// TestK8sClusteredShape checks that the manifests show the clustered shape
// of docs/design.md §9 (admission's replicas and QF_INSTANCES: TestK8sEnv):
// two or more accounter replicas on one durable, a Redis
// Cluster URL that redisconn opens as a cluster client over three seeds,
// and R3 streams.
func TestK8sClusteredShape(t *testing.T) {
	env := map[string]string{}
	deps := map[string]*appsv1.Deployment{}
	for _, o := range k8sManifests(t) {
		switch o := o.(type) {
		case *corev1.ConfigMap:
			if o.Name == "quotaflow-env" {
				env = o.Data
			}
		case *appsv1.Deployment:
			deps[o.Name] = o
		}
	}
	if got := env["QF_STREAM_REPLICAS"]; got != "3" {
		t.Errorf("quotaflow-env QF_STREAM_REPLICAS = %q, want 3 (R3 streams on a 3-node JetStream cluster)", got)
	}
	c, err := redisconn.Open(env["QF_REDIS_URL"])
	if err != nil {
		t.Fatalf("quotaflow-env QF_REDIS_URL: %v", err)
	}
	defer c.Close()
	cc, ok := c.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("quotaflow-env QF_REDIS_URL opens a %T, want a Redis Cluster client", c)
	}
	if seeds := cc.Options().Addrs; len(seeds) < 3 {
		t.Errorf("QF_REDIS_URL names %d seed nodes %v, want 3 or more", len(seeds), seeds)
	}

	replicas := func(name string) (int, map[string]string) {
		d, ok := deps[name]
		if !ok || d.Spec.Replicas == nil || len(d.Spec.Template.Spec.Containers) != 1 {
			t.Fatalf("Deployment %s: missing, without replicas or not one container", name)
		}
		vars := map[string]string{}
		for _, e := range d.Spec.Template.Spec.Containers[0].Env {
			vars[e.Name] = e.Value
		}
		return int(*d.Spec.Replicas), vars
	}
	n, vars := replicas("accounter")
	if n < 2 || vars["QF_DURABLE"] == "" {
		t.Errorf("accounter: %d replicas on durable %q; want 2 or more on one named durable", n, vars["QF_DURABLE"])
	}
	for name, d := range deps {
		if !slices.ContainsFunc(d.Spec.Template.Spec.Containers[0].EnvFrom, func(s corev1.EnvFromSource) bool {
			return s.ConfigMapRef != nil && s.ConfigMapRef.Name == "quotaflow-env"
		}) {
			t.Errorf("Deployment %s does not read quotaflow-env (the cluster URLs and stream replicas)", name)
		}
	}
}
