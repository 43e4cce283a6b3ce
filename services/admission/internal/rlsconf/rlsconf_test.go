package rlsconf

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
)

// The peer's own test configurations load, or fail, as they do in the
// peer; duplicate_domain fails only beside another file of its domain.
func TestParsePeerConfigs(t *testing.T) {
	valid := map[string]bool{
		"basic_config.yaml": true, "duplicate_domain.yaml": true, "merge_domain_key1.yaml": true,
		"merge_domain_key2.yaml": true, "shadowmode_config.yaml": true, "share_threshold.yaml": true,
		"wildcard.yaml": true, "example_config.yaml": true, "example_example.yaml": true,
	}
	files, err := filepath.Glob(filepath.Join("testdata", "peer", "*.yaml"))
	if err != nil || len(files) < 20 {
		t.Fatalf("peer configs: %v, %v", files, err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		_, err = Parse(File{Name: filepath.Base(f), Data: data})
		if want := valid[filepath.Base(f)]; (err == nil) != want {
			t.Errorf("Parse(%s) = %v, want valid %v", filepath.Base(f), err, want)
		} else if err != nil && !strings.HasPrefix(err.Error(), filepath.Base(f)+": ") {
			t.Errorf("Parse(%s) error %q does not name the file", filepath.Base(f), err)
		}
	}
	d, _ := os.ReadFile(filepath.Join("testdata", "peer", "duplicate_domain.yaml"))
	b, _ := os.ReadFile(filepath.Join("testdata", "peer", "basic_config.yaml"))
	if _, err := Parse(File{"a.yaml", b}, File{"b.yaml", d}); err == nil || !strings.Contains(err.Error(), "b.yaml: domain") {
		t.Errorf("two files of one domain = %v, want b.yaml's domain refused", err)
	}
}

func entries(kv ...string) []*rlv3.RateLimitDescriptor_Entry {
	var es []*rlv3.RateLimitDescriptor_Entry
	for i := 0; i+1 < len(kv); i += 2 {
		es = append(es, &rlv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return es
}

// Match follows the peer's lookup: key and value, then a wildcard in file
// order, then the key alone; the limit of the node the last entry reaches.
func TestMatch(t *testing.T) {
	var files []File
	for _, n := range []string{"basic_config.yaml", "wildcard.yaml", "share_threshold.yaml"} {
		data, err := os.ReadFile(filepath.Join("testdata", "peer", n))
		if err != nil {
			t.Fatal(err)
		}
		// wildcard.yaml and share_threshold.yaml name basic_config's domain too.
		data = []byte(strings.Replace(string(data), "domain: test-domain", "domain: "+strings.TrimSuffix(n, ".yaml"), 1))
		files = append(files, File{n, data})
	}
	c, err := Parse(files...)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		domain string
		kv     []string
		want   string // "100/minute", "unlimited", "" for none
		shared string
	}{
		{"basic_config", []string{"key1", "value1"}, "", ""},                                  // no limit on the node
		{"basic_config", []string{"key1", "value1", "subkey1", "x"}, "5/second", ""},          // key alone
		{"basic_config", []string{"key1", "value1", "subkey1", "subvalue1"}, "10/second", ""}, // key and value first
		{"basic_config", []string{"key2", "anything"}, "20/minute", ""},
		{"basic_config", []string{"key2", "value2"}, "30/minute", ""},
		{"basic_config", []string{"key2", "value3"}, "", ""}, // whitelisted: a node without a limit
		{"basic_config", []string{"key5", "value5", "subkey5", "subvalue5"}, "25/day", ""},
		{"basic_config", []string{"key5", "value5", "other", "x"}, "", ""}, // the tree ends before the last entry
		{"basic_config", []string{"key3", "x", "deeper", "y"}, "", ""},     // a leaf reached before the last entry
		{"basic_config", []string{"key6", "x"}, "unlimited", ""},
		{"nowhere", []string{"key2", "value2"}, "", ""},
		{"wildcard", []string{"wild", "foobar"}, "20/minute", ""},
		{"wildcard", []string{"wild", "fo"}, "", ""},
		{"wildcard", []string{"midWild", "barxb"}, "", ""}, // only a trailing '*' is a wildcard
		{"wildcard", []string{"nestedWild", "val1", "wild", "goose"}, "20/minute", ""},
		{"share_threshold", []string{"files", "files/a.txt"}, "100/minute", "files/*"},
		{"share_threshold", []string{"nested", "parent", "files", "nested/b"}, "200/minute", "nested/*"},
	} {
		l, shared := c.Match(m.domain, entries(m.kv...))
		got := ""
		switch {
		case l != nil && l.Unlimited:
			got = "unlimited"
		case l != nil:
			got = strings.ToLower(fmtLimit(l))
		}
		var gotShared string
		if shared != nil {
			gotShared = shared[len(shared)-1]
		}
		if got != m.want || gotShared != m.shared {
			t.Errorf("Match(%s, %v) = %q shared %q, want %q shared %q", m.domain, m.kv, got, gotShared, m.want, m.shared)
		}
	}
}

func fmtLimit(l *Limit) string {
	return strings.TrimSpace(strings.Join([]string{itoa(l.RequestsPerUnit), l.Unit.String()}, "/"))
}

func itoa(n uint32) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// Units are envoy's dividers: month is 30 days, year 365.
func TestUnitWindows(t *testing.T) {
	c, err := Parse(File{"u.yaml", []byte(`domain: u
descriptors:
  - {key: s, rate_limit: {unit: SECOND, requests_per_unit: 1}}
  - {key: w, rate_limit: {unit: week, requests_per_unit: 1}}
  - {key: m, rate_limit: {unit: month, requests_per_unit: 1}}
  - {key: y, rate_limit: {unit: year, requests_per_unit: 1}}
`)})
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]time.Duration{"s": time.Second, "w": 7 * 24 * time.Hour, "m": 30 * 24 * time.Hour, "y": 365 * 24 * time.Hour} {
		if l, _ := c.Match("u", entries(k, "v")); l == nil || l.Window != want {
			t.Errorf("unit of %s = %v, want %v", k, l, want)
		}
	}
}

// Hostile or mistaken files are refused with the file and the path.
func TestParseRejects(t *testing.T) {
	deep := "domain: d\ndescriptors:\n"
	for i := range MaxDepth + 1 {
		deep += strings.Repeat("  ", 2*i) + "  - key: k\n" + strings.Repeat("  ", 2*i) + "    descriptors:\n"
	}
	deep += strings.Repeat("  ", 2*(MaxDepth+1)) + "  - key: leaf\n"
	for _, c := range []struct{ name, yaml, want string }{
		{"deep", deep, "nested deeper than 16"},
		{"unknown key", "domain: d\ndescriptors:\n  - key: k\n    rate_limt: {unit: second}\n", "field rate_limt not found"},
		{"big count", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 4294967296}\n", "requests_per_unit: 4294967296"},
		{"negative count", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n", "requests_per_unit: -1"},
		{"fraction", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1.5}\n", "not a whole number"},
		{"no unit", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}\n", `d.k.rate_limit: unit: ""`},
		{"bad unit", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n", `unit: "fortnight"`},
		{"control", "domain: d\ndescriptors:\n  - key: \"k\\x01\"\n", "control character"},
		{"long value", "domain: d\ndescriptors:\n  - key: k\n    value: " + strings.Repeat("v", 257) + "\n", "longer than 256"},
		{"two documents", "domain: d\n---\ndomain: e\n", "more than one YAML document"},
		{"empty", "", "empty"},
		{"quota mode", "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n", "quota_mode: not supported"},
		{"share without wildcard", "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n", "only with a wildcard"},
	} {
		_, err := Parse(File{c.name + ".yaml", []byte(c.yaml)})
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), c.name+".yaml: ") {
			t.Errorf("%s: Parse = %v, want an error naming the file and %q", c.name, err, c.want)
		}
	}
	if _, err := Parse(File{"big.yaml", make([]byte, MaxFileBytes+1)}); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Parse(too large) = %v", err)
	}
}

// Load reads one file or every *.yaml/*.yml file of a directory, hidden
// ones and others left out.
func TestLoadDirectory(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a.yaml", "domain: a\ndescriptors:\n  - {key: k, rate_limit: {unit: second, requests_per_unit: 1}}\n")
	write("b.yml", "domain: b\n")
	write(".hidden.yaml", "not: [valid")
	write("notes.txt", "not: [valid")
	c, err := Load(dir)
	if err != nil || c.Domains() != 2 || !c.HasDomain("a") || !c.HasDomain("b") {
		t.Fatalf("Load(dir) = %v, %v; want domains a and b", c, err)
	}
	if c1, err := Load(filepath.Join(dir, "a.yaml")); err != nil || c1.Domains() != 1 {
		t.Errorf("Load(file) = %v, %v", c1, err)
	}
	write("c.yaml", "domain: a\n")
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "c.yaml: domain") {
		t.Errorf("Load(dir with a domain twice) = %v", err)
	}
}

// FuzzParse: whatever the bytes, Parse returns a Config or an error, never
// panics, and matching any descriptor against what it returns never panics
// either. The seeds are the peer's configurations.
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join("testdata", "peer", "*.yaml"))
	for _, p := range files {
		data, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, "key1", "value1")
	}
	f.Fuzz(func(t *testing.T, data []byte, key, value string) {
		c, err := Parse(File{"f.yaml", data})
		if err != nil {
			if !strings.HasPrefix(err.Error(), "f.yaml") {
				t.Errorf("error %q does not name the file", err)
			}
			return
		}
		for d := range c.domains {
			c.Match(d, entries(key, value, key, value))
		}
	})
}
