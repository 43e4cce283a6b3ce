// Package rlsconf loads envoyproxy/ratelimit's own configuration
// (QF_ENVOY_RATELIMIT_CONFIG, docs/design.md §4): YAML files of a domain and
// a tree of descriptors with their rate limits, as envoy's users already
// have them, and matches a request's descriptors against them with the
// peer's rules (src/config/config_impl.go of envoyproxy/ratelimit): an
// entry matches its key and value first, then a wildcard value ("foo*", in
// file order), then the key alone (any value); a descriptor gets the limit
// of the node its last entry reaches, and none when the tree ends first or
// the node has none.
//
// share_threshold makes every value its wildcard matches count in one
// counter, as in envoy. The metrics-only keys (detailed_metric,
// value_to_metric) are accepted and change nothing.
//
// Each limit is a quotaflow fixed window (policy.Fixed, aligned to the Unix
// epoch as envoy's are) of requests_per_unit per unit: second, minute,
// hour, day, week, month (30 days, as envoy's) or year (365 days). Parse
// rejects what envoy rejects (an empty domain or key, a duplicate domain
// or descriptor, a unit with unlimited, a missing unit, an empty or
// self-naming replaces entry, share_threshold without a wildcard, unknown
// keys) and bounds what a hostile or mistaken file could make costly:
// sizes, depth, counts and identifier lengths (the Max constants).
package rlsconf

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.yaml.in/yaml/v3"

	"quotaflow/pkg/yamldoc"
)

// Bounds of a configuration. A real one is a few kilobytes and a few levels
// deep; the bounds keep a wrong path or a generated file from costing memory
// or stack.
const (
	MaxFileBytes    = 1 << 20   // one file
	MaxTotalBytes   = 8 << 20   // every file of a directory together
	MaxFiles        = 256       // files in a directory
	MaxDepth        = 16        // nesting of descriptors
	MaxDescriptors  = 100_000   // descriptor nodes of every file together
	MaxIDBytes      = 256       // a domain, key, value or limit name
	MaxReplaces     = 64        // replaces entries of one limit
	maxRequestsUnit = 1<<32 - 1 // requests_per_unit is envoy's uint32
)

// Limit is the rate limit of a descriptor node.
type Limit struct {
	// RequestsPerUnit per Unit; 0 is always over the limit, as in envoy.
	RequestsPerUnit uint32
	Unit            rlspb.RateLimitResponse_RateLimit_Unit
	// Window is Unit's length (envoy's divider).
	Window time.Duration
	// Unlimited descriptors are OK and counted nowhere.
	Unlimited bool
	// Shadow limits count but never deny (shadow_mode).
	Shadow bool
	// Name, when set, lets other limits of the same request replace this one.
	Name string
	// Replaces names the limits this one replaces in a request.
	Replaces []string
	// Path identifies the node the limit belongs to ("domain.key_value.key"),
	// for logs.
	Path string
}

// UnitWindow is the window of unit as envoy counts it (UnitToDivider), and
// false for UNKNOWN or a value outside the enum.
func UnitWindow(u rlspb.RateLimitResponse_RateLimit_Unit) (time.Duration, bool) {
	const day = 24 * time.Hour
	switch u {
	case rlspb.RateLimitResponse_RateLimit_SECOND:
		return time.Second, true
	case rlspb.RateLimitResponse_RateLimit_MINUTE:
		return time.Minute, true
	case rlspb.RateLimitResponse_RateLimit_HOUR:
		return time.Hour, true
	case rlspb.RateLimitResponse_RateLimit_DAY:
		return day, true
	case rlspb.RateLimitResponse_RateLimit_WEEK:
		return 7 * day, true
	case rlspb.RateLimitResponse_RateLimit_MONTH:
		return 30 * day, true
	case rlspb.RateLimitResponse_RateLimit_YEAR:
		return 365 * day, true
	}
	return 0, false
}

// node is one descriptor of the tree: its children by "key_value" or "key",
// the children's wildcard keys in file order, and its limit.
type node struct {
	children  map[string]*node
	wildcards []string
	limit     *Limit
	// share is the wildcard value ("files/*") of a share_threshold node:
	// every value it matches counts in one counter.
	share string
}

// Config is a loaded configuration: every domain's descriptor tree. It is
// read-only once loaded and safe for concurrent use. The zero Config has no
// domain.
type Config struct {
	domains map[string]*node
	digest  string
	files   int
}

// Digest is the hex SHA-256 of the files the configuration was loaded from,
// in name order, for logs.
func (c *Config) Digest() string { return c.digest }

// Domains is the number of domains.
func (c *Config) Domains() int { return len(c.domains) }

// HasDomain reports whether domain is configured.
func (c *Config) HasDomain(domain string) bool {
	_, ok := c.domains[domain]
	return ok
}

// Match returns the limit of a descriptor of domain, or nil when none
// applies (unknown domain, no matching node, a match that ends before the
// descriptor's last entry or on a node without a limit). shared is nil
// unless a share_threshold wildcard matched an entry: then it holds, per
// entry, the wildcard value that names the counter in place of the entry's
// value ("" where the value itself counts), as envoy's cache key does.
func (c *Config) Match(domain string, entries []*rlv3.RateLimitDescriptor_Entry) (l *Limit, shared []string) {
	n := c.domains[domain]
	if n == nil {
		return nil, nil
	}
	for i, e := range entries {
		key := e.GetKey() + "_" + e.GetValue()
		next := n.children[key]
		if next == nil {
			for _, w := range n.wildcards {
				if strings.HasPrefix(key, strings.TrimSuffix(w, "*")) {
					if next = n.children[w]; next.share != "" {
						if shared == nil {
							shared = make([]string, len(entries))
						}
						shared[i] = next.share
					}
					break
				}
			}
		}
		if next == nil {
			next = n.children[e.GetKey()]
		}
		if next != nil && next.limit != nil && i == len(entries)-1 {
			l = next.limit
		}
		if next == nil || len(next.children) == 0 {
			break
		}
		n = next
	}
	if l == nil {
		shared = nil
	}
	return l, shared
}

// yamlRoot, yamlDescriptor and yamlLimit are the file's shape (envoy's
// YamlRoot); unknown keys are rejected.
type yamlRoot struct {
	Domain      string           `yaml:"domain"`
	Descriptors []yamlDescriptor `yaml:"descriptors"`
}

type yamlDescriptor struct {
	Key            string           `yaml:"key"`
	Value          string           `yaml:"value"`
	RateLimit      *yamlLimit       `yaml:"rate_limit"`
	Descriptors    []yamlDescriptor `yaml:"descriptors"`
	ShadowMode     bool             `yaml:"shadow_mode"`
	QuotaMode      bool             `yaml:"quota_mode"`
	DetailedMetric bool             `yaml:"detailed_metric"`
	ValueToMetric  bool             `yaml:"value_to_metric"`
	ShareThreshold bool             `yaml:"share_threshold"`
}

type yamlLimit struct {
	RequestsPerUnit count  `yaml:"requests_per_unit"`
	Unit            string `yaml:"unit"`
	Unlimited       bool   `yaml:"unlimited"`
	Name            string `yaml:"name"`
	Replaces        []struct {
		Name string `yaml:"name"`
	} `yaml:"replaces"`
}

// count is a whole number in YAML: a fraction or a string is an error, not
// a truncated count.
type count int64

func (c *count) UnmarshalYAML(n *yaml.Node) error {
	var v int64
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
		return fmt.Errorf("line %d: %q is not a whole number", n.Line, n.Value)
	}
	if err := n.Decode(&v); err != nil {
		return err
	}
	*c = count(v)
	return nil
}

// File is one configuration file's name (for errors) and content.
type File struct {
	Name string
	Data []byte
}

// Parse loads files (each one domain) into one Config. Every problem of
// every file comes back joined, each naming its file and the descriptor's
// path.
func Parse(files ...File) (*Config, error) {
	c := &Config{domains: map[string]*node{}, files: len(files)}
	var errs []error
	total, count := 0, 0
	for _, f := range files {
		total += len(f.Data)
		if len(f.Data) > MaxFileBytes {
			errs = append(errs, fmt.Errorf("%s: larger than %d bytes", f.Name, MaxFileBytes))
			continue
		}
		if err := c.load(f, &count); err != nil {
			errs = append(errs, err)
		}
	}
	if total > MaxTotalBytes {
		errs = append(errs, fmt.Errorf("configuration: %d bytes, more than %d", total, MaxTotalBytes))
	}
	if len(files) > MaxFiles {
		errs = append(errs, fmt.Errorf("configuration: %d files, more than %d", len(files), MaxFiles))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	c.digest = digest(files)
	return c, nil
}

// digest is the hex SHA-256 of files: each one's name and content, in
// order, each length-prefixed so that no two lists hash alike.
func digest(files []File) string {
	h := sha256.New()
	for _, f := range files {
		fmt.Fprintf(h, "%d:%s%d:", len(f.Name), f.Name, len(f.Data))
		h.Write(f.Data)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// load adds one file's domain.
func (c *Config) load(f File, count *int) error {
	dec := yaml.NewDecoder(bytes.NewReader(f.Data))
	dec.KnownFields(true)
	var root yamlRoot
	if err := dec.Decode(&root); err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("%s: empty", f.Name)
		}
		return fmt.Errorf("%s: %w", f.Name, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%s: more than one YAML document", f.Name)
	}
	l := loader{file: f.Name, count: count}
	if root.Domain == "" {
		l.bad("domain", "empty: every file names its domain")
	} else if err := checkID(root.Domain); err != "" {
		l.bad("domain", err)
	} else if _, dup := c.domains[root.Domain]; dup {
		l.bad("domain", fmt.Sprintf("%q is also in another file", root.Domain))
	}
	n := &node{children: map[string]*node{}}
	l.descriptors(n, root.Domain, root.Descriptors, 1)
	if len(l.errs) == 0 {
		c.domains[root.Domain] = n
	}
	return errors.Join(l.errs...)
}

// loader builds one file's tree, collecting its problems.
type loader struct {
	file  string
	count *int
	errs  []error
}

func (l *loader) bad(path, problem string) {
	l.errs = append(l.errs, fmt.Errorf("%s: %s: %s", l.file, path, problem))
}

// descriptors adds ds as n's children; path names n.
func (l *loader) descriptors(n *node, path string, ds []yamlDescriptor, depth int) {
	if len(ds) > 0 && depth > MaxDepth {
		l.bad(path, fmt.Sprintf("descriptors nested deeper than %d", MaxDepth))
		return
	}
	for i := range ds {
		d := &ds[i]
		*l.count++
		if *l.count > MaxDescriptors {
			l.bad(path, fmt.Sprintf("more than %d descriptors", MaxDescriptors))
			return
		}
		key := d.Key
		if d.Value != "" {
			key += "_" + d.Value
		}
		at := fmt.Sprintf("%s.descriptors[%d]", path, i)
		switch {
		case d.Key == "":
			l.bad(at, "key: empty")
			continue
		case checkID(d.Key) != "":
			l.bad(at, "key: "+checkID(d.Key))
			continue
		case d.Value != "" && checkID(d.Value) != "":
			l.bad(at, "value: "+checkID(d.Value))
			continue
		}
		at = path + "." + key
		if _, dup := n.children[key]; dup {
			l.bad(at, "duplicate descriptor")
			continue
		}
		if d.ShareThreshold && !strings.HasSuffix(key, "*") {
			l.bad(at, "share_threshold: only with a wildcard value (ending in '*')")
		}
		if d.QuotaMode {
			l.bad(at, "quota_mode: not supported by quotaflow (see the README's differences from envoy)")
		}
		child := &node{children: map[string]*node{}}
		if d.ShareThreshold {
			child.share = d.Value
		}
		if d.RateLimit != nil {
			child.limit = l.limit(at, d)
		}
		if strings.HasSuffix(key, "*") {
			n.wildcards = append(n.wildcards, key)
		}
		n.children[key] = child
		l.descriptors(child, at, d.Descriptors, depth+1)
	}
}

// limit checks and returns the rate limit of d, at path.
func (l *loader) limit(path string, d *yamlDescriptor) *Limit {
	y := d.RateLimit
	path += ".rate_limit"
	lim := &Limit{Unlimited: y.Unlimited, Shadow: d.ShadowMode, Name: y.Name, Path: path}
	v, known := rlspb.RateLimitResponse_RateLimit_Unit_value[strings.ToUpper(y.Unit)]
	lim.Unit = rlspb.RateLimitResponse_RateLimit_Unit(v)
	w, valid := UnitWindow(lim.Unit)
	valid = valid && known
	switch {
	case y.Unlimited && y.Unit != "":
		l.bad(path, "unit: not with unlimited")
	case !y.Unlimited && !valid:
		l.bad(path, fmt.Sprintf("unit: %q: want second, minute, hour, day, week, month or year", y.Unit))
	}
	lim.Window = w
	if y.RequestsPerUnit < 0 || y.RequestsPerUnit > maxRequestsUnit {
		l.bad(path, fmt.Sprintf("requests_per_unit: %d: want 0 to %d", y.RequestsPerUnit, int64(maxRequestsUnit)))
	} else {
		lim.RequestsPerUnit = uint32(y.RequestsPerUnit)
	}
	if y.Name != "" && checkID(y.Name) != "" {
		l.bad(path, "name: "+checkID(y.Name))
	}
	if len(y.Replaces) > MaxReplaces {
		l.bad(path, fmt.Sprintf("replaces: more than %d", MaxReplaces))
		return lim
	}
	for i, r := range y.Replaces {
		switch {
		case r.Name == "":
			l.bad(fmt.Sprintf("%s.replaces[%d]", path, i), "name: empty")
		case r.Name == y.Name:
			l.bad(fmt.Sprintf("%s.replaces[%d]", path, i), "name: the limit's own")
		case checkID(r.Name) != "":
			l.bad(fmt.Sprintf("%s.replaces[%d]", path, i), "name: "+checkID(r.Name))
		default:
			if !slices.Contains(lim.Replaces, r.Name) {
				lim.Replaces = append(lim.Replaces, r.Name)
			}
		}
	}
	return lim
}

// checkID returns what is wrong with a domain, key, value or name: more
// than MaxIDBytes, invalid UTF-8 or a control character; "" when nothing.
func checkID(s string) string {
	switch {
	case len(s) > MaxIDBytes:
		return fmt.Sprintf("longer than %d bytes", MaxIDBytes)
	case !utf8.ValidString(s):
		return "not valid UTF-8"
	case strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return "holds a control character"
	}
	return ""
}

// Load reads path: one YAML file, or a directory whose *.yaml and *.yml
// files (not hidden ones, not in subdirectories) each hold one domain, as
// envoy's runtime directory does. Errors name the files.
func Load(path string) (*Config, error) {
	files, err := readFiles(path)
	if err != nil {
		return nil, err
	}
	return Parse(files...)
}

// readFiles reads the files Load parses.
func readFiles(path string) ([]File, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("QF_ENVOY_RATELIMIT_CONFIG: %w", err)
	}
	if !st.IsDir() {
		data, err := readFile(path)
		if err != nil {
			return nil, err
		}
		return []File{{Name: path, Data: data}}, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("QF_ENVOY_RATELIMIT_CONFIG: %w", err)
	}
	var files []File
	for _, e := range ents {
		name := e.Name()
		ext := filepath.Ext(name)
		if strings.HasPrefix(name, ".") || ext != ".yaml" && ext != ".yml" {
			continue
		}
		full := filepath.Join(path, name)
		if st, err := os.Stat(full); err != nil || st.IsDir() {
			continue // a dangling link or a directory named *.yaml
		}
		if len(files) == MaxFiles {
			return nil, fmt.Errorf("QF_ENVOY_RATELIMIT_CONFIG %s: more than %d files", path, MaxFiles)
		}
		data, err := readFile(full)
		if err != nil {
			return nil, err
		}
		files = append(files, File{Name: full, Data: data})
	}
	return files, nil
}

// readFile reads at most one byte past MaxFileBytes, so that Parse can tell
// the file is too large.
func readFile(path string) ([]byte, error) {
	data, err := yamldoc.ReadFile(path, MaxFileBytes)
	if err != nil {
		return nil, fmt.Errorf("QF_ENVOY_RATELIMIT_CONFIG: %w", err)
	}
	return data, nil
}
