package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"quotaflow/pkg/yamldoc"
)

// MaxPolicySize is the largest policy Parse and LoadFile accept, in bytes
// (1 MiB). A real policy is a few kilobytes; the cap keeps a wrong path (a
// log file, a device) from being read into memory.
const MaxPolicySize = 1 << 20

// LoadFile reads and parses the policy file at path; see Parse. Errors name
// the file.
func LoadFile(path string) (*Policy, error) {
	data, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	p, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("load policy %s: %w", path, err)
	}
	return p, nil
}

// ReadFile reads a policy file, at most one byte past MaxPolicySize so that
// Parse can tell it is too large. LoadFile is ReadFile, then Parse; a
// reloader that skips content it has seen reads with it and compares
// DigestOf.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("load policy: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxPolicySize+1))
	if err != nil {
		return nil, fmt.Errorf("load policy %s: %w", path, err)
	}
	return data, nil
}

// DigestOf is the Digest of a Policy parsed from data.
func DigestOf(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// Parse decodes one policy document (YAML), checks it and returns it ready
// for Resolve, with defaults filled in: each limit's Unit, DefaultBuckets for
// rolling limits without buckets, empty entries for plans, tenants and
// endpoints written as null.
//
// Parse rejects unknown fields, numbers where a whole number is due (limit,
// burst, buckets), durations that are not Go duration strings ("5h",
// "168h", "1s"; a bare 0 is allowed), more than one YAML document and input
// over MaxPolicySize. Problems of shape and every rule of Validate come back
// together, as *Error values joined with errors.Join in the order of
// the file's sections and sorted keys, so one run shows every mistake; YAML
// syntax errors come alone with their line.
func Parse(data []byte) (*Policy, error) {
	if len(data) > MaxPolicySize {
		return nil, fmt.Errorf("policy is larger than %d bytes (1 MiB)", MaxPolicySize)
	}
	root, err := yamldoc.Decode(data, "policy")
	if err != nil {
		return nil, err
	}

	// The schema walk gives shape errors a path, where the decoder would give
	// a line and a Go type name, and catches what the decoder lets through:
	// it truncates 1.5 to 1 in an integer field.
	w := schemaWalker{}
	w.walk(root, reflect.TypeFor[Policy](), "")
	if len(w.errs) > 0 {
		return nil, errors.Join(w.errs...)
	}

	var p Policy
	strict := yaml.NewDecoder(bytes.NewReader(data))
	strict.KnownFields(true) // the walk checks fields too; this is the backstop
	if err := strict.Decode(&p); err != nil {
		return nil, fmt.Errorf("parse policy: %w", err)
	}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p.normalize()
	p.idx = buildIndex(&p, DigestOf(data))
	return &p, nil
}

// Digest is the hex SHA-256 of the bytes the policy was parsed from, for
// logs and for telling which version of a file is in force. It is empty for
// a Policy built in code.
func (p *Policy) Digest() string {
	if p.idx == nil {
		return ""
	}
	return p.idx.digest
}

// String formats d like time.Duration ("5h0m0s").
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalYAML writes d as a Go duration string, which UnmarshalYAML reads
// back.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// UnmarshalYAML reads a Go duration string ("5h", "168h", "1s", "1m30s").
// A bare number is rejected, since its unit would be a guess, except 0.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, problem := parseDurationNode(n)
	if problem != "" {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %s", n.Line, problem)}}
	}
	*d = Duration(v)
	return nil
}

// parseDurationNode parses a YAML duration scalar, or says what is wrong
// with it.
func parseDurationNode(n *yaml.Node) (time.Duration, string) {
	if n.Kind != yaml.ScalarNode {
		return 0, `must be a duration such as "30s" or "5h"`
	}
	switch n.ShortTag() {
	case "!!str":
		v, err := time.ParseDuration(n.Value)
		if err == nil {
			return v, ""
		}
		if days, ok := strings.CutSuffix(n.Value, "d"); ok {
			if k, err := strconv.Atoi(days); err == nil && k > 0 && k <= 400 {
				return 0, fmt.Sprintf("invalid duration %q: Go durations have no days, write %q", n.Value, strconv.Itoa(24*k)+"h")
			}
		}
		return 0, fmt.Sprintf(`invalid duration %q: want a number and a unit (ms, s, m, h), e.g. "90s" or "5h"`, n.Value)
	case "!!int":
		if v, err := strconv.ParseInt(n.Value, 0, 64); err == nil && v == 0 {
			return 0, ""
		}
	}
	return 0, fmt.Sprintf(`must be a duration with a unit, e.g. "30s" or "5h", got %s`, n.Value)
}

// UnmarshalYAML reads a mapping of input_weight and output_weight; a weight
// left out is 1.
func (m *ModelWeights) UnmarshalYAML(n *yaml.Node) error {
	type plain ModelWeights // drops this method, so Decode does not recurse
	v := plain{InputWeight: 1, OutputWeight: 1}
	if err := n.Decode(&v); err != nil {
		return err
	}
	*m = ModelWeights(v)
	return nil
}

// maxSchemaSteps bounds the nodes the schema walk visits. Aliases can make a
// small document expand enormously; yaml's decoder refuses such documents
// itself, so the walk just stops and leaves them to it.
const maxSchemaSteps = 1 << 20

// schemaWalker checks a YAML tree against the shape of the Go type it will be
// decoded into, with paths in the same form as Validate's.
type schemaWalker struct {
	errs  []error
	steps int
}

func (w *schemaWalker) add(path, format string, args ...any) {
	w.errs = append(w.errs, &Error{Path: path, Problem: fmt.Sprintf(format, args...)})
}

var durationType = reflect.TypeFor[Duration]()

func (w *schemaWalker) walk(n *yaml.Node, t reflect.Type, path string) {
	if w.steps++; w.steps > maxSchemaSteps {
		return
	}
	switch n.Kind {
	case yaml.DocumentNode:
		if len(n.Content) == 0 {
			return
		}
		w.walk(n.Content[0], t, path)
		return
	case yaml.AliasNode:
		if n.Alias != nil {
			w.walk(n.Alias, t, path)
		}
		return
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return // decodes as the zero value; Validate judges that
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == durationType:
		if _, problem := parseDurationNode(n); problem != "" {
			w.add(path, "%s", problem)
		}
	case t.Kind() == reflect.Struct, t.Kind() == reflect.Map:
		w.mapping(n, t, path)
	case t.Kind() == reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			w.add(path, "must be a list")
			return
		}
		for i, c := range n.Content {
			w.walk(c, t.Elem(), indexPath(path, i))
		}
	default:
		w.scalar(n, t, path)
	}
}

func (w *schemaWalker) mapping(n *yaml.Node, t reflect.Type, path string) {
	if n.Kind != yaml.MappingNode {
		if path == "" {
			w.add(path, "must be a mapping of default_plan, plans, tenants, endpoints, ip, models and shadow")
			return
		}
		w.add(path, "must be a mapping")
		return
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.ShortTag() == "!!merge" { // <<: *alias merges another mapping in
			if v.Kind == yaml.SequenceNode {
				for _, c := range v.Content {
					w.walk(c, t, path)
				}
			} else {
				w.walk(v, t, path)
			}
			continue
		}
		if k.Kind != yaml.ScalarNode {
			w.add(path, "keys must be strings (line %d)", k.Line)
			continue
		}
		p := keyPath(path, k.Value)
		if t.Kind() == reflect.Map {
			w.walk(v, t.Elem(), p)
			continue
		}
		ft, ok := yamlField(t, k.Value)
		if !ok {
			w.add(p, "unknown field (want %s)", strings.Join(yamlFieldNames(t), ", "))
			continue
		}
		w.walk(v, ft, p)
	}
}

func (w *schemaWalker) scalar(n *yaml.Node, t reflect.Type, path string) {
	var want string
	switch t.Kind() {
	case reflect.Int, reflect.Int64:
		want = "a whole number"
		if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!float" {
			// yaml would truncate 1.5 to 1: accept only whole floats (1e6).
			var f float64
			if n.Decode(&f) == nil && f == math.Trunc(f) && math.Abs(f) < 1<<62 {
				return
			}
			w.add(path, "must be %s, got %s", want, n.Value)
			return
		}
	case reflect.Float64:
		want = "a number"
	case reflect.Bool:
		want = "true or false"
	case reflect.String:
		want = "a string"
	default:
		return
	}
	if n.Kind != yaml.ScalarNode {
		w.add(path, "must be %s", want)
		return
	}
	if err := n.Decode(reflect.New(t).Interface()); err != nil {
		w.add(path, "must be %s, got %q", want, n.Value)
	}
}

// yamlField returns the type of the struct field that YAML key name decodes
// into.
func yamlField(t reflect.Type, name string) (reflect.Type, bool) {
	for f := range t.Fields() {
		if tagName(f) == name {
			return f.Type, true
		}
	}
	return nil, false
}

// yamlFieldNames lists the YAML keys of struct type t, in field order.
func yamlFieldNames(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if n := tagName(f); n != "" {
			names = append(names, n)
		}
	}
	return names
}

// tagName is the YAML key of a struct field, or "" for a field YAML skips.
func tagName(f reflect.StructField) string {
	if !f.IsExported() {
		return ""
	}
	tag := f.Tag.Get("yaml")
	if tag == "-" {
		return ""
	}
	name, _, _ := strings.Cut(tag, ",")
	if name == "" {
		return strings.ToLower(f.Name)
	}
	return name
}
