package policy

import (
	"bytes"
	"maps"
	"reflect"
	"slices"
	"testing"

	"go.yaml.in/yaml/v3"
)

// FuzzParse checks that Parse never panics on any input and that whatever
// it accepts is a policy that holds up: it validates again, survives a
// round trip through YAML unchanged, and resolves every tenant, plan and
// endpoint combination without error, to the same rules with and without
// the precomputed index. The seed corpus is testdata/fuzz/FuzzParse.
func FuzzParse(f *testing.F) {
	f.Add([]byte(designPolicy))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data)
		if err != nil {
			if p != nil {
				t.Fatalf("Parse(%q) = %v and error %v, want nil with an error", data, p, err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("Parse(%q) accepted a policy that Validate rejects: %v", data, err)
		}

		out, err := yaml.Marshal(p)
		if err != nil {
			t.Fatalf("yaml.Marshal(Parse(%q)) error = %v", data, err)
		}
		p2, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Marshal(Parse(%q))) error = %v; marshalled:\n%s", data, err, out)
		}
		out2, err := yaml.Marshal(p2)
		if err != nil || !bytes.Equal(out, out2) {
			t.Fatalf("round trip of %q changed the policy:\n%s\nthen\n%s", data, out, out2)
		}

		slow := *p
		slow.idx = nil
		tenants := append(slices.Sorted(maps.Keys(p.Tenants)), "", "no-such-tenant")
		plans := append(slices.Sorted(maps.Keys(p.Plans)), "")
		endpoints := append(slices.Sorted(maps.Keys(p.Endpoints)), "", "/no/such/endpoint")
		if len(tenants)*len(plans)*len(endpoints) > 1000 {
			tenants, plans, endpoints = tenants[:1], plans[:1], endpoints[:1]
		}
		for _, tenant := range tenants {
			for _, plan := range plans {
				for _, ep := range endpoints {
					r, err := p.Resolve(tenant, plan, ep)
					if err != nil {
						t.Fatalf("Resolve(%q, %q, %q) error = %v", tenant, plan, ep, err)
					}
					if plan != "" && r.Plan != plan {
						t.Fatalf("Resolve(%q, %q, %q).Plan = %q", tenant, plan, ep, r.Plan)
					}
					rs, err := slow.Resolve(tenant, plan, ep)
					if err != nil || !reflect.DeepEqual(r, rs) {
						t.Fatalf("Resolve(%q, %q, %q) = %+v, without index %+v, %v", tenant, plan, ep, r, rs, err)
					}
					for _, layer := range [][]Rule{r.IP, r.Global, r.Subject} {
						for _, rule := range layer {
							if rule.Unit != Tokens && rule.Unit != Requests {
								t.Fatalf("Resolve(%q, %q, %q) rule %+v has no unit", tenant, plan, ep, rule)
							}
						}
					}
				}
			}
		}
		if w := p.LongestTokenWindow(); w < 0 || w > maxWindow {
			t.Fatalf("LongestTokenWindow() = %v, out of [0, 400 days]", w)
		}
		for m := range p.Models {
			if c := p.Cost(m, 1000, 1000); c < 0 {
				t.Fatalf("Cost(%q, 1000, 1000) = %d, want ≥ 0", m, c)
			}
		}
	})
}
