package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"

	"go.yaml.in/yaml/v3"

	"quotaflow/pkg/yamldoc"
)

// MaxFileSize is the largest tokens file accepted (1 MiB): thousands of
// entries, and a wrong path (a log, a device) is not read into memory.
const MaxFileSize = 1 << 20

// fileFields are the keys of an entry of the file, in the order messages
// name them.
const fileFields = "token or sha256, tenant, roles"

// ParseFile parses the content of a QF_API_TOKENS_FILE: a YAML list of
// entries, each a mapping of
//
//	token:  the token itself, or
//	sha256: the 64 hex digits of the token's SHA-256 (exactly one of the two)
//	tenant: the tenant the token is bound to (optional: every tenant)
//	roles:  a list of gateway, report, billing, admin (optional: gateway and report)
//
// "[]" is a file of no tokens; an empty file is an error, so that a file
// caught half-written revokes nothing. Every problem comes back at once,
// joined with errors.Join, each as the path of the mistake and what is
// wrong ("[2].roles[0]: unknown role ..."); a key the file should not
// hold is named by its line, never quoted, since a misplaced token would be
// one.
func ParseFile(data []byte) ([]Entry, error) {
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("file is larger than %d bytes (1 MiB)", MaxFileSize)
	}
	doc, err := yamldoc.Decode(data, "file")
	if errors.Is(err, yamldoc.ErrEmpty) {
		return nil, errors.New("file is empty; write [] for a file of no tokens")
	}
	if err != nil {
		return nil, err
	}
	list := doc
	if len(list.Content) == 1 {
		list = deref(list.Content[0])
	}
	if list.Kind != yaml.SequenceNode {
		return nil, errors.New("file must be a list of entries of " + fileFields)
	}
	p := fileParser{}
	out := make([]Entry, 0, len(list.Content))
	for i, n := range list.Content {
		if e, ok := p.entry(deref(n), "["+strconv.Itoa(i)+"]"); ok {
			out = append(out, e)
		}
	}
	if err := errors.Join(p.errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// deref follows an alias to the node it names.
func deref(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

// fileParser collects the problems of one file.
type fileParser struct {
	errs []error
}

func (p *fileParser) add(path, format string, args ...any) {
	p.errs = append(p.errs, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

// entry reads one entry of the file at path; ok is false when it has a
// problem (added to p).
func (p *fileParser) entry(n *yaml.Node, path string) (e Entry, ok bool) {
	if n.Kind != yaml.MappingNode {
		p.add(path, "must be a mapping of %s", fileFields)
		return Entry{}, false
	}
	before := len(p.errs)
	var tok, sum, tenant *string
	var roles *yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := deref(n.Content[i]), deref(n.Content[i+1])
		var dst **string
		switch k.Value {
		case "token":
			dst = &tok
		case "sha256":
			dst = &sum
		case "tenant":
			dst = &tenant
		case "roles":
			if roles != nil {
				p.add(path+".roles", "given twice")
			}
			roles = v
			continue
		default:
			p.add(path, "unknown field on line %d (want %s)", k.Line, fileFields)
			continue
		}
		fp := path + "." + k.Value
		switch {
		case *dst != nil:
			p.add(fp, "given twice")
		case v.Kind != yaml.ScalarNode || v.ShortTag() == "!!null":
			p.add(fp, "must be a string")
		default:
			*dst = &v.Value
		}
	}

	switch {
	case tok != nil && sum != nil:
		p.add(path, "give token or sha256, not both")
	case tok != nil:
		if msg := tokenProblem(*tok); msg != "" {
			p.add(path+".token", "%s", msg)
		}
		e.digest = sha256.Sum256([]byte(*tok))
	case sum != nil:
		if b, err := hex.DecodeString(*sum); err != nil || len(b) != len(e.digest) {
			p.add(path+".sha256", "want the 64 hex digits of the token's SHA-256")
		} else {
			copy(e.digest[:], b)
		}
	default:
		p.add(path, "token or sha256 required")
	}
	if tenant != nil {
		e.Tenant = *tenant
		if msg := tenantProblem(e.Tenant); msg != "" {
			p.add(path+".tenant", "%s", msg)
		}
	}
	e.Roles = DefaultRoles
	if roles != nil {
		e.Roles = p.roles(roles, path+".roles")
	}
	if msg := e.Grant.problem(); msg != "" {
		p.add(path+".roles", "%s", msg)
	}
	return e, len(p.errs) == before
}

// roles reads an entry's list of roles.
func (p *fileParser) roles(n *yaml.Node, path string) Roles {
	if n.Kind != yaml.SequenceNode {
		p.add(path, "must be a list of roles (%s)", wantRoles)
		return 0
	}
	if len(n.Content) == 0 {
		p.add(path, "empty: leave roles out for gateway and report")
		return 0
	}
	var rs Roles
	for i, c := range n.Content {
		c = deref(c)
		r, ok := parseRole(c.Value)
		if c.Kind != yaml.ScalarNode || !ok {
			p.add(path+"["+strconv.Itoa(i)+"]", "unknown role (%s)", wantRoles)
			continue
		}
		rs |= r
	}
	return rs
}
