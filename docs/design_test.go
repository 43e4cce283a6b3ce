package docs

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// root is the repository, one level above this package.
const root = ".."

var (
	sectionRe = regexp.MustCompile(`(?m)^## (\d+)\. `)
	// Links a reader follows from the contract into the code: relative
	// markdown links.
	linkRe = regexp.MustCompile(`\]\((\.\./[^)#\s]+)\)`)
	// References from the code back into the contract: "design.md §4",
	// "design.md §4–§6", "design.md §7, §8".
	refRe = regexp.MustCompile(`design\.md((?:[ ,–-]*§\d+)+)`)
	numRe = regexp.MustCompile(`§(\d+)`)
)

// sections splits design.md into its numbered sections.
func sections(t *testing.T) (text string, bodies map[int]string) {
	t.Helper()
	b, err := os.ReadFile("design.md")
	if err != nil {
		t.Fatal(err)
	}
	text = string(b)
	bodies = map[int]string{}
	idx := sectionRe.FindAllStringSubmatchIndex(text, -1)
	for i, m := range idx {
		n, _ := strconv.Atoi(text[m[2]:m[3]])
		end := len(text)
		if i+1 < len(idx) {
			end = idx[i+1][0]
		}
		bodies[n] = text[m[0]:end]
	}
	if len(bodies) == 0 {
		t.Fatal("design.md has no numbered sections")
	}
	return text, bodies
}

// Every section names the code that implements it, and every path the
// contract links to exists, so a reader gets from a clause to its code in
// one step.
func TestDesignLinksExist(t *testing.T) {
	text, bodies := sections(t)
	for n, body := range bodies {
		if !strings.Contains(body, "\nCode: ") {
			t.Errorf("§%d has no `Code:` line naming the files that implement it", n)
		}
	}
	links := linkRe.FindAllStringSubmatch(text, -1)
	if len(links) < len(bodies) {
		t.Fatalf("design.md links to %d paths, fewer than its %d sections", len(links), len(bodies))
	}
	for _, l := range links {
		if _, err := os.Stat(filepath.FromSlash(l[1])); err != nil {
			t.Errorf("design.md links to %s, which does not exist", l[1])
		}
	}
}

// Every reference to the contract from code, SQL, configs and docs names
// a section that exists; none cites the old out-of-repo DESIGN.
func TestReferencesToDesignResolve(t *testing.T) {
	_, bodies := sections(t)
	self, _ := filepath.Abs(".")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".go", ".lua", ".sql", ".md", ".yml", ".yaml", ".sh", ".json":
		default:
			return nil
		}
		if abs, _ := filepath.Abs(path); filepath.Dir(abs) == self {
			return nil // this package cites itself in examples
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		s := string(b)
		if strings.Contains(s, "DESIGN §") || strings.Contains(s, "DESIGN.md") {
			t.Errorf("%s cites DESIGN, which is docs/design.md now", path)
		}
		for _, m := range refRe.FindAllStringSubmatch(s, -1) {
			for _, num := range numRe.FindAllStringSubmatch(m[1], -1) {
				n, _ := strconv.Atoi(num[1])
				if _, ok := bodies[n]; !ok {
					t.Errorf("%s cites design.md §%d, which does not exist", path, n)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The import rules of §1: pkg/ is public and stands alone; the event
// contract has no transport; the policy model has no Redis. allowed names
// packages under a forbidden prefix that a rule still lets in.
func TestLayoutImports(t *testing.T) {
	const module = "quotaflow/"
	rules := []struct {
		dir       string
		forbidden []string
		allowed   []string
		why       string
	}{
		{"pkg", []string{module + "internal", module + "services", module + "cmd"}, nil, "pkg/ imports nothing of the services'"},
		{"pkg/events", []string{"github.com/nats-io", module + "pkg/events/stream"}, nil, "the event contract has no transport"},
		// hash48 (the rules' ids) imports nothing but strconv.
		{"pkg/limits/policy", []string{"github.com/redis", module + "pkg/limits"}, []string{module + "pkg/limits/internal/hash48"}, "the policy model is pure Go"},
	}
	for _, r := range rules {
		checked := 0
		err := filepath.WalkDir(filepath.Join(root, r.dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() {
				if d.Name() == "testdata" {
					return filepath.SkipDir
				}
				// The contract packages are checked alone, not with their
				// subpackages (events/stream may import NATS).
				if r.dir != "pkg" && path != filepath.Join(root, r.dir) {
					return filepath.SkipDir
				}
				return nil
			}
			if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
			if err != nil {
				return err
			}
			checked++
			for _, imp := range f.Imports {
				p, _ := strconv.Unquote(imp.Path.Value)
				if slices.Contains(r.allowed, p) {
					continue
				}
				for _, bad := range r.forbidden {
					if p == bad || strings.HasPrefix(p, bad+"/") {
						t.Errorf("%s imports %s: %s", path, p, r.why)
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if checked == 0 {
			t.Errorf("no Go files under %s: the rule checks nothing", r.dir)
		}
	}
}
