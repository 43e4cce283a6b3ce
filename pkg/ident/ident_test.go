package ident

import (
	"errors"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name, v string
		want    error
	}{
		{"empty", "", nil},
		{"ascii", "acme/u-42 r:1 ~!", nil},
		{"space", " ", nil},
		{"unicode", "東京 é 🙂 \u2028 \u00a0 \ufeff", nil},
		{"replacement character", "\ufffd", nil},
		{"max ascii", strings.Repeat("x", MaxLen), nil},
		{"max multibyte", strings.Repeat("é", MaxLen/2), nil},
		{"ascii one over", strings.Repeat("x", MaxLen+1), ErrTooLong},
		{"multibyte straddling the limit", strings.Repeat("x", MaxLen-1) + "é", ErrTooLong},
		{"nul", "a\x00b", ErrControl},
		{"nul alone", "\x00", ErrControl},
		{"tab", "a\tb", ErrControl},
		{"newline", "a\n", ErrControl},
		{"unit separator", "\x1f", ErrControl},
		{"del", "a\x7fb", ErrControl},
		{"c1 first", "a\u0080b", ErrControl},
		{"c1 last", "\u009f", ErrControl},
		{"after c1", "\u00a0", nil},
		{"control after unicode", "é\x00", ErrControl},
		{"invalid byte", "a\xffb", ErrInvalidUTF8},
		{"lone continuation", "\x80", ErrInvalidUTF8},
		{"truncated sequence", "\xc3", ErrInvalidUTF8},
		{"encoded surrogate", "\xed\xa0\x80", ErrInvalidUTF8},
		{"invalid beats control", "\x00\xff", ErrInvalidUTF8},
		{"length beats everything", strings.Repeat("\x00", MaxLen+1), ErrTooLong},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Check(tc.v); !errors.Is(got, tc.want) || (got == nil) != (tc.want == nil) {
				t.Errorf("Check(%q) = %v, want %v", tc.v, got, tc.want)
			}
		})
	}
}

func TestMessages(t *testing.T) {
	for err, want := range map[error]string{
		ErrTooLong:     "longer than 256 bytes",
		ErrInvalidUTF8: "not valid UTF-8",
		ErrControl:     "contains a control character",
	} {
		if err.Error() != want {
			t.Errorf("%q, want %q", err.Error(), want)
		}
	}
}

// IsControl is exactly Unicode's Cc, which unicode.IsControl implements.
func TestIsControl(t *testing.T) {
	for r := rune(0); r <= unicode.MaxRune; r++ {
		if IsControl(r) != unicode.Is(unicode.Cc, r) {
			t.Fatalf("IsControl(%U) = %v", r, IsControl(r))
		}
	}
}

// FuzzCheck holds Check to the rule written out plainly.
func FuzzCheck(f *testing.F) {
	for _, s := range []string{"", "acme", "a\x00", "\u0085", "\x7f", "\xff", "é", strings.Repeat("é", 129)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		want := len(v) <= MaxLen && utf8.ValidString(v) && !strings.ContainsFunc(v, unicode.IsControl)
		if got := Check(v); (got == nil) != want {
			t.Fatalf("Check(%q) = %v, want valid=%v", v, got, want)
		}
	})
}

func BenchmarkCheck(b *testing.B) {
	for _, bc := range []struct{ name, v string }{
		{"ascii", "tenant-0042/user-1234567"},
		{"unicode", "東京-user-1234567"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if Check(bc.v) != nil {
					b.Fatal("rejected")
				}
			}
		})
	}
}
