package deploytest

import (
	"os"
	"path/filepath"
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
