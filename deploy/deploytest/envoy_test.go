package deploytest

import (
	"encoding/json"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"

	// The typed_config types the configurations name: imported so that
	// protojson resolves their Any values (an unknown type fails the test).
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_authz/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/lua/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// envoyConfigs are the Envoy bootstrap files of the README's gateway
// matrix, under deploy/gateways/envoy/, by the filter each must hold.
var envoyConfigs = map[string]string{
	"ext-authz-http.yaml":        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
	"ext-authz-grpc.yaml":        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
	"ratelimit.yaml":             "envoy.extensions.filters.http.ratelimit.v3.RateLimit",
	"ratelimit-stream-done.yaml": "envoy.extensions.filters.http.ratelimit.v3.RateLimit",
}

// streamDoneIDs are, per configuration correlating a request's two rate
// limit calls, the descriptor keys of x-request-id by action kind
// ("apply_on_stream_done <bool>: <key>").
var streamDoneIDs = map[string]map[string]bool{
	"ratelimit-stream-done.yaml": {"apply_on_stream_done false: request_id": true, "apply_on_stream_done true: actual_id": true},
}

// TestEnvoyConfigs parses each Envoy configuration into go-control-plane's
// bootstrap type (strictly: an unknown field or typed_config type fails),
// runs the protos' validation rules, and checks what Envoy would check at
// start-up beyond them: no deprecated field, and every cluster a filter or
// route names is defined. No Envoy binary can be installed here, so this
// is as far as the files are tested.
func TestEnvoyConfigs(t *testing.T) {
	var found []string
	for _, f := range yamlFiles(t) {
		if path.Dir(f) == "gateways/envoy" {
			found = append(found, path.Base(f))
		}
	}
	for name := range envoyConfigs {
		if !slices.Contains(found, name) {
			t.Errorf("deploy/gateways/envoy/%s is missing (the README's gateway matrix links it)", name)
		}
	}
	for _, name := range found {
		t.Run(name, func(t *testing.T) {
			rel := "gateways/envoy/" + name
			var doc any
			decodeInto(t, decodeAll(t, rel)[0], &doc)
			js, err := json.Marshal(doc)
			if err != nil {
				t.Fatal(err)
			}
			var b bootstrapv3.Bootstrap
			if err := protojson.Unmarshal(js, &b); err != nil {
				t.Fatalf("%s does not parse as an Envoy bootstrap: %v", rel, err)
			}
			if err := b.ValidateAll(); err != nil {
				t.Fatalf("%s is not a valid Envoy bootstrap: %v", rel, err)
			}
			w := envoyWalk{clusters: map[string]bool{}, types: map[string]bool{}, requestIDs: map[string]bool{}}
			for _, c := range b.GetStaticResources().GetClusters() {
				w.clusters[c.GetName()] = true
			}
			w.walk(t, b.ProtoReflect(), "")
			if want := envoyConfigs[name]; want != "" && !w.types[want] {
				t.Errorf("%s has no %s filter", rel, want)
			}
			// The response-time call is marked by its own key for the
			// request id (QF_ENVOY_ACTUAL_ID_KEY), which only the
			// apply_on_stream_done action sets.
			if want := streamDoneIDs[name]; want != nil && !maps.Equal(w.requestIDs, want) {
				t.Errorf("%s: x-request-id's descriptor keys %v, want %v", rel, slices.Sorted(maps.Keys(w.requestIDs)), slices.Sorted(maps.Keys(want)))
			}
		})
	}
}

// envoyWalk visits every field of a bootstrap, typed_config values
// included.
type envoyWalk struct {
	clusters map[string]bool // defined
	types    map[string]bool // message types seen
	// requestIDs are the rate limit actions on x-request-id
	// (streamDoneIDs).
	requestIDs map[string]bool
}

func (w envoyWalk) walk(t *testing.T, m protoreflect.Message, at string) {
	t.Helper()
	w.types[string(m.Descriptor().FullName())] = true
	if rl, ok := m.Interface().(*routev3.RateLimit); ok {
		for _, a := range rl.GetActions() {
			if h := a.GetRequestHeaders(); strings.EqualFold(h.GetHeaderName(), "x-request-id") {
				w.requestIDs[fmt.Sprintf("apply_on_stream_done %v: %s", rl.GetApplyOnStreamDone(), h.GetDescriptorKey())] = true
			}
		}
	}
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			t.Errorf("%s: %v", strings.TrimPrefix(at, "."), err)
			return
		}
		if v, ok := inner.(interface{ ValidateAll() error }); ok {
			if err := v.ValidateAll(); err != nil {
				t.Errorf("%s (%s): %v", strings.TrimPrefix(at, "."), a.GetTypeUrl(), err)
			}
		}
		w.walk(t, inner.ProtoReflect(), at)
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := at + "." + string(fd.Name())
		if opts, ok := fd.Options().(*descriptorpb.FieldOptions); ok && opts.GetDeprecated() {
			t.Errorf("%s is deprecated", strings.TrimPrefix(p, "."))
		}
		switch {
		case fd.Kind() == protoreflect.StringKind && !fd.IsList() && !fd.IsMap() &&
			(fd.Name() == "cluster" || fd.Name() == "cluster_name"):
			if !w.clusters[v.String()] {
				t.Errorf("%s names cluster %q, which is not defined", strings.TrimPrefix(p, "."), v.String())
			}
		case fd.Kind() != protoreflect.MessageKind && fd.Kind() != protoreflect.GroupKind:
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				w.walk(t, l.Get(i).Message(), p)
			}
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					w.walk(t, mv.Message(), p)
					return true
				})
			}
		default:
			w.walk(t, v.Message(), p)
		}
		return true
	})
}
