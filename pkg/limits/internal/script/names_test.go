package script

import (
	"fmt"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/wire"
)

// Every name is used by the engine's code, means one number, and none is
// left in the code Redis runs.
func TestLuaNamesAreUsedAndExpanded(t *testing.T) {
	used := map[string]bool{}
	for _, c := range append([][2]string{{"lib", luaLib}}, engineCode...) {
		if _, err := expandNames(c[1], used); err != nil {
			t.Fatalf("lua/%s.lua: %v", c[0], err)
		}
	}
	want := []string{"NILS"}
	for name := range luaNames {
		if _, ok := wire.LuaNames[name]; ok {
			t.Errorf("%s is named twice", name)
		}
		want = append(want, name)
	}
	for name := range wire.LuaNames {
		want = append(want, name)
	}
	for flag := range wire.LuaFlags {
		want = append(want, "IS_"+flag)
	}
	for _, name := range want {
		if !used[name] {
			t.Errorf("%s is defined but no Lua code uses it", name)
		}
	}
	left := map[string]bool{}
	if out, err := expandNames(engine.code, left); err != nil || len(left) > 0 || out != engine.code {
		t.Fatalf("the library still has names: %v %v", err, left)
	}
	lib := mustExpand("lib", luaLib)
	for _, c := range engineCode {
		src := lib + mustExpand(c[0], c[1])
		if !strings.Contains(engine.code, src[len(lib):]) || engine.entries[c[0]].script().Hash() != redis.NewScript(src).Hash() {
			t.Errorf("%s: the script is not the library's expanded code", c[0])
		}
	}
}

func TestExpandNames(t *testing.T) {
	for src, want := range map[string]string{
		"S[o + ROLL_TOTAL]":            "S[o + 13]",
		"if IS_SHADOW(fl) then":        "if ((fl) % 4 >= 2) then",
		"not IS_TOKENS(S[o + FLAGS])":  "not ((S[o + 2]) % 2 >= 1)",
		"IS_TENANT(fl) and ten or sub": "((fl) >= 4) and ten or sub",
		"{ h, NILS(3) }":               "{ h, nil, nil, nil }",
		"t[x[1]] --[not long]":         "t[x[1]] --[not long]",
		"-- ROLL_TOTAL and 'LIMIT'\n'ID' .. \"KIND\" .. KEYS[1] .. ARGV[2] .. S[1] .. 1e12 .. _": "-- ROLL_TOTAL and 'LIMIT'\n'ID' .. \"KIND\" .. KEYS[1] .. ARGV[2] .. S[1] .. 1e12 .. _",
	} {
		if got, err := expandNames(src, nil); err != nil || got != want {
			t.Errorf("%q: got %q, %v; want %q", src, got, err, want)
		}
	}
	for _, src := range []string{
		"S[o + ROLL_TOTL]",   // a misspelt name
		"local Z6 = 1",       // a capital that is no name
		"IS_BLUE(fl)",        // no such flag
		"IS_SHADOW fl",       // no argument
		"IS_SHADOW(fl",       // unclosed
		"{ NILS(many) }",     // no count
		"--[[ a comment ]]",  // long brackets are not read
		"--[==[ a comment",   //
		"x = [[ a string ]]", //
		"x = 'unfinished",    //
	} {
		if got, err := expandNames(src, nil); err == nil {
			t.Errorf("%q: got %q, want an error", src, got)
		}
	}
}

// A flag test holds exactly for the flags bytes Go packs with that bit set.
func TestLuaFlagTestsMatchTheBits(t *testing.T) {
	var all int64
	for _, f := range wire.LuaFlags {
		all |= f
	}
	for name, f := range wire.LuaFlags {
		var b strings.Builder
		if err := writeFlagTest(&b, name, "x"); err != nil {
			t.Fatal(err)
		}
		var mod, min int64
		test := func(x int64) bool { return x%mod >= min }
		if _, err := fmt.Sscanf(b.String(), "((x) %% %d >= %d)", &mod, &min); err != nil {
			mod = all + 1 // the highest bit: x >= f
			if _, err := fmt.Sscanf(b.String(), "((x) >= %d)", &min); err != nil {
				t.Fatalf("%s: %q", name, b.String())
			}
		}
		for x := int64(0); x <= all; x++ {
			if test(x) != (x&f != 0) {
				t.Errorf("%s: %q on %d", name, b.String(), x)
			}
		}
	}
}
