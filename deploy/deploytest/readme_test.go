package deploytest

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestREADMENginxMatchesFile: the README's nginx configuration is
// deploy/gateways/nginx/quotaflow.conf, which services/admission/nginx_test.go
// runs in front of real nginx. Only comments and layout may differ: a
// directive the README lacks (as its location /api/ once lacked the
// X-Quota-Tenant and X-Quota-User it sets for the backend, letting the
// client's own pass) is one a reader copying it would miss.
func TestREADMENginxMatchesFile(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	block := fencedBlock(t, string(readme), "### nginx", "nginx")
	file, err := os.ReadFile(filepath.Join(deployDir, "gateways", "nginx", "quotaflow.conf"))
	if err != nil {
		t.Fatal(err)
	}
	got, want := nginxStatements(block), nginxStatements(string(file))
	if slices.Equal(got, want) {
		return
	}
	for i := range max(len(got), len(want)) {
		var g, w string
		if i < len(got) {
			g = got[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if g != w {
			t.Fatalf("README.md's nginx block differs from deploy/gateways/nginx/quotaflow.conf at statement %d:\nREADME: %s\nfile:   %s", i+1, g, w)
		}
	}
}

// fencedBlock is the first ```lang block after the line heading in md.
func fencedBlock(t *testing.T, md, heading, lang string) string {
	t.Helper()
	_, after, ok := strings.Cut(md, "\n"+heading+"\n")
	if !ok {
		t.Fatalf("README.md has no %q section", heading)
	}
	_, after, ok = strings.Cut(after, "\n```"+lang+"\n")
	if !ok {
		t.Fatalf("README.md's %q section has no ```%s block", heading, lang)
	}
	block, _, ok := strings.Cut(after, "\n```\n")
	if !ok {
		t.Fatalf("README.md's %q block is not closed", heading)
	}
	return block
}

// nginxStatements splits an nginx configuration into its statements, each
// its words joined by one space and ended by ";", "{" or "}", without
// comments (a # that starts a word, outside quotes).
func nginxStatements(conf string) []string {
	var out, words []string
	var word strings.Builder
	var quote rune
	inWord, comment := false, false
	flush := func() {
		if inWord {
			words = append(words, word.String())
			word.Reset()
			inWord = false
		}
	}
	for _, r := range conf {
		switch {
		case comment:
			comment = r != '\n'
		case quote != 0:
			word.WriteRune(r)
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			word.WriteRune(r)
			inWord, quote = true, r
		case r == '#' && !inWord:
			comment = true
		case r == ';' || r == '{' || r == '}':
			flush()
			out = append(out, strings.Join(append(words, string(r)), " "))
			words = words[:0]
		case r == ' ' || r == '\t' || r == '\n' || r == '\r':
			flush()
		default:
			word.WriteRune(r)
			inWord = true
		}
	}
	flush()
	if len(words) > 0 {
		out = append(out, strings.Join(words, " "))
	}
	return out
}

// The splitter keeps quoted # and ; and drops comments.
func TestNginxStatements(t *testing.T) {
	got := nginxStatements("a b; # c;\nreturn 429 '{\"x\":\"#y;\"}';  # z\nloc /x { d \"e f\"; }\n")
	want := []string{"a b ;", `return 429 '{"x":"#y;"}' ;`, "loc /x {", `d "e f" ;`, "}"}
	if !slices.Equal(got, want) {
		t.Errorf("nginxStatements = %q, want %q", got, want)
	}
}

// TestAddrPortsDistinct: where the README, design.md or a file under deploy/
// gives an address variable (QF_*_ADDR) a port, the port is not another
// address variable's default, which the same machine or pod may already
// listen on (the Envoy configurations once put QF_GRPC_ADDR on 8081, the
// console's QF_CONSOLE_ADDR, and the README QF_GATEWAY_ADDR).
func TestAddrPortsDistinct(t *testing.T) {
	defaults := map[string]string{} // port: variable
	files, err := filepath.Glob(filepath.Join(repoRoot, "services", "*", "config.go"))
	if err != nil || len(files) != len(services) {
		t.Fatalf("services' config.go: %v, %v", files, err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range addrDefaultRe.FindAllStringSubmatch(string(b), -1) {
			defaults[m[2]] = "QF_" + m[1]
		}
	}
	if defaults["8081"] != "QF_CONSOLE_ADDR" || defaults["8080"] != "QF_ADMISSION_ADDR" {
		t.Fatalf("address defaults %v: the scanner is broken", defaults)
	}
	docs := []string{filepath.Join(repoRoot, "README.md"), filepath.Join(repoRoot, "docs", "design.md")}
	err = filepath.WalkDir(deployDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && !strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, ".json") {
			docs = append(docs, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, p := range docs {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		check := func(v, port string) {
			seen++
			if w := defaults[port]; w != "" && w != v {
				t.Errorf("%s puts %s on port %s, %s's default", p, v, port, w)
			}
		}
		for _, m := range addrThenPortRe.FindAllStringSubmatch(string(b), -1) {
			check(m[1], m[2])
		}
		for _, m := range portThenAddrRe.FindAllStringSubmatch(string(b), -1) {
			check(m[2], m[1])
		}
	}
	if seen < 10 {
		t.Fatalf("found %d addresses given a port: the scanner is broken", seen)
	}
}

var (
	// A service's default address: envconfig:"CONSOLE_ADDR" default:":8081".
	addrDefaultRe = regexp.MustCompile(`envconfig:"([A-Z_]+_ADDR)" default:":(\d+)"`)
	// QF_GATEWAY_ADDR=:8085, QF_GRPC_ADDR (here 127.0.0.1:8084),
	// QF_CONSOLE_ADDR: ":8081", {name: QF_CONSOLE_ADDR, value: ":8081"},
	// `QF_ALERTS_ADDR` (default `:8082`...
	addrThenPortRe = regexp.MustCompile(`(QF_[A-Z_]+_ADDR)\b[^\n]{0,12}?(?:\d{1,3}(?:\.\d{1,3}){3}|localhost)?:(\d{2,5})\b`)
	// port_value: 8084}  # QF_GRPC_ADDR, server 127.0.0.1:8080;  # QF_ADMISSION_ADDR
	portThenAddrRe = regexp.MustCompile(`(?:port_value: *|:)(\d{2,5})\}?;? *# *(QF_[A-Z_]+_ADDR)\b`)
)
