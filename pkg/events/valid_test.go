package events

import (
	"encoding/json"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// validCases are inputs on both sides of every rule of the JSON grammar.
var validCases = []string{
	``, ` `, `{}`, `[]`, ` { } `, `[ ]`, `{"a":1}`, `{"a" : [1, 2.5, -0, 1e3, 1E+3, 1e-3, true, false, null, "x"]}`,
	`[[[]]]`, `[{}]`, `{"a":{"b":{}}}`, `"x"`, `0`, `-1`, `1.25`, `true`, `null`,
	`{`, `}`, `[`, `]`, `{"a"}`, `{"a":}`, `{"a":1,}`, `[1,]`, `[,1]`, `{,"a":1}`, `{"a":1 "b":2}`, `[1 2]`,
	`{1:2}`, `{"a":1]`, `[1}`, `[]]`, `{}}`, `[] []`, `1 2`, `{} x`,
	`01`, `-`, `-01`, `1.`, `.5`, `1e`, `1e+`, `+1`, `1.5e3.2`, `-0.0e-0`, `1x`,
	`tru`, `truex`, `nul`, `nulll`, `fals`, `True`,
	`"\"\\\/\b\f\n\r\t\u00e9\uD83D\uDE00"`, `"\x"`, `"\u12"`, `"\u12g4"`, `"\`, `"abc`, "\"a\x01\"", "\"a\x7f\"",
	"\"\xff\xfe\"", "[\"\xc3\"]", "\t\n\r[1]\r\n\t", "\v[1]", "[1]\x00",
	strings.Repeat("[", 10000) + strings.Repeat("]", 10000),
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
	strings.Repeat(`{"a":`, 10000) + "1" + strings.Repeat("}", 10000),
	strings.Repeat(`{"a":`, 10001) + "1" + strings.Repeat("}", 10001),
}

func TestValidJSON(t *testing.T) {
	for _, c := range validCases {
		if got, want := validate([]byte(c), nil), json.Valid([]byte(c)); got != want {
			t.Errorf("validate(%.40q) = %v, want %v (json.Valid)", c, got, want)
		}
	}
	for _, ev := range examples() {
		b, err := Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		if !validate(b, nil) {
			t.Errorf("validate(%s) = false", b)
		}
	}
}

// FuzzValidJSON holds validate to json.Valid's answer, and the spans
// validate records of a valid text to the containers skipValue walks:
// every '{' and '[' outside strings, each ending where skipValue ends it.
// Seeds: testdata/fuzz/FuzzValidJSON, validCases and the examples.
func FuzzValidJSON(f *testing.F) {
	for _, c := range validCases {
		f.Add([]byte(c))
	}
	for _, ev := range examples() {
		b, err := Encode(ev)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := validate(b, nil), json.Valid(b); got != want {
			t.Fatalf("validate(%q) = %v, want %v (json.Valid)", b, got, want)
		}
		var s spans
		if !validate(b, &s) {
			return
		}
		var open []int32
		for i := 0; i < len(b); i++ {
			switch b[i] {
			case '"':
				end, _ := scanString(b, i)
				i = end - 1
			case '{', '[':
				open = append(open, int32(i))
			}
		}
		if !slices.Equal(s.open, open) {
			t.Fatalf("validate(%q) recorded containers at %v, they open at %v", b, s.open, open)
		}
		for k, at := range s.open {
			if want := skipValue(b, int(at)); int(s.end[k]) != want {
				t.Fatalf("validate(%q): the container at %d ends at %d, skipValue says %d", b, at, s.end[k], want)
			}
		}
	})
}

// plain stops where a byte-at-a-time scan would: at the first '"', '\\'
// or control byte from i on, or within the last 7 bytes before it.
func TestPlain(t *testing.T) {
	alphabet := []byte{'"', '\\', 0, 0x1f, 0x20, 'a', '~', 0x7f, 0x80, 0xc3, 0xff}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		b := make([]byte, rng.IntN(40))
		for j := range b {
			b[j] = 'a'
			if rng.IntN(8) == 0 {
				b[j] = alphabet[rng.IntN(len(alphabet))]
			}
		}
		for i := 0; i <= len(b); i++ {
			want := i
			for want < len(b) && b[want] != '"' && b[want] != '\\' && b[want] >= 0x20 {
				want++
			}
			got := plain(b, i)
			if got > want || got < i || got < want && got < len(b)-7 {
				t.Fatalf("plain(%q, %d) = %d, the first such byte is at %d", b, i, got, want)
			}
		}
	}
}
