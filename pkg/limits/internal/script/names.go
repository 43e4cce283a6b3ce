package script

import (
	"fmt"
	"strconv"
	"strings"

	"quotaflow/pkg/limits/internal/wire"
)

// The Lua engine writes its numbers as names: the slots of lib.lua's state
// table (luaNames), and the codes and sizes of the protocol that Go packs
// and decodes (wire.LuaNames). As Lua locals they would cost an upvalue
// read per use (a VM operation), so newLibrary replaces each name by its
// number before the library is hashed, and Redis runs the code it would
// run had the numbers been written in. Lines stay where they were, so
// Redis's error lines still point into lua/*.lua.
//
// A name is an identifier in capitals in Lua code (comments and strings are
// left alone); the only other capitals are luaCapitals. Two names take an
// argument: IS_<FLAG>(x) tests a bit (wire.LuaFlags) of a spec's flags byte
// x, NILS(n) is n nils, the body of a table constructor that presizes a
// table at no cost. A capital no table names fails the package's
// initialisation.

// luaNames are the numbers only the Lua code knows.
var luaNames = map[string]int64{
	// Limit j's slots in the state table S start after (j-1)*SLOTS: its
	// spec, where it lives, and whether it changed...
	"SLOTS": 19, "STATE_SLOTS": 114, // per limit; S's presized capacity (6 limits)
	"KIND": 1, "FLAGS": 2, "LIMIT": 3, "SPEC_A": 4, "SPEC_B": 5, "ID": 6,
	"BLOB":       7, // the open blob (table) holding its record
	"PAYLOAD":    8, // where its payload starts in SRC (false: none)
	"DIRTY":      9, // its state changed: store writes it
	"WOULD_DENY": 16,
	"SRC":        17, // the string holding its record: the blob as read, or the record an earlier reserve of a batch stored
	"REC":        19, // its record's base index in the blob (false: none yet)
	// ...then its state from slot 10 on, by kind.
	"ROLL_NOW":     10, // rolling: the current bucket's number
	"ROLL_HEAD":    11, // the head bucket's number, as stored
	"ROLL_TAIL":    12, // the oldest non-empty bucket's number
	"ROLL_TOTAL":   13, // the window's total
	"ROLL_AT":      14, // the number of the one bucket whose counter changed (false: none)
	"ROLL_AT_USED": 18, // that bucket's counter
	"ROLL_BUCKETS": 15, // every counter as a table, bucket k at k % b + 1 (false: not unpacked)
	"WIN_NUM":      10, // fixed: the window's number; calendar: the month's
	"WIN_USED":     11,
	"WIN_END":      12, // when the window ends, ms
	"TB_LEVEL":     10, // token bucket: tokens left (refilling) or used (rate 0)
	"TB_TIME":      11, // the last refill (refilling) or the period's start (rate 0), ms
	"LOG_TIMES":    10, // sliding log: the entries' times, oldest first
	"LOG_FIRST":    11, // the first entry still in the window
	"BAL_CREDITED": 10,
	"BAL_SPENT":    11,
	"CONC_USED":    10, // concurrency: slots taken
	"CONC_KEY":     11, // the sorted set
	"CONC_MEMBER":  12, // the member add took or gave back (false: none)
	"CONC_DELTA":   13, // +1 took it, -1 gave it back

	"NEVER":     1<<47 - 1,     // a blob record's expiry that never comes
	"DAYS_28":   28 * 86400000, // the shortest month, ms
	"PLANS_MAX": 512,           // the most plans fast keeps unpacked (~0.85 kB each at five limits)
}

// luaCapitals are the capitals of the Lua code that are no names: Redis's
// KEYS and ARGV, and lib.lua's state table S.
var luaCapitals = map[string]bool{"KEYS": true, "ARGV": true, "S": true}

// expandNames returns Lua code src with its names replaced (see above) and
// marks each name it met in used, unless used is nil.
func expandNames(src string, used map[string]bool) (string, error) {
	var b strings.Builder
	b.Grow(len(src))
	for i := 0; i < len(src); {
		c, rest := src[i], src[i:]
		j := i + 1
		switch {
		case longBracket(rest) || strings.HasPrefix(rest, "--") && longBracket(rest[2:]):
			return "", nameError(src, i, "a long bracket (comment or string) is not supported")
		case strings.HasPrefix(rest, "--"):
			j = i + len(rest)
			if k := strings.IndexByte(rest, '\n'); k >= 0 {
				j = i + k
			}
		case c == '\'' || c == '"':
			for j < len(src) && src[j] != c && src[j] != '\n' {
				if src[j] == '\\' {
					j++
				}
				j++
			}
			if j >= len(src) || src[j] != c {
				return "", nameError(src, i, "unfinished string")
			}
			j++
		case isDigit(c):
			for j < len(src) && (isWord(src[j]) || src[j] == '.') {
				j++
			}
		case isWord(c):
			for j < len(src) && isWord(src[j]) {
				j++
			}
			word := src[i:j]
			if !isCapital(word) || luaCapitals[word] {
				break
			}
			if v, ok := nameValue(word); ok {
				mark(used, word)
				b.WriteString(strconv.FormatInt(v, 10))
				i = j
				continue
			}
			flag, isFlag := strings.CutPrefix(word, "IS_")
			if !isFlag && word != "NILS" {
				return "", nameError(src, i, "unknown name "+word)
			}
			arg, end, err := argument(src, j, used)
			if err != nil {
				return "", nameError(src, i, word+": "+err.Error())
			}
			mark(used, word)
			if isFlag {
				if err := writeFlagTest(&b, flag, arg); err != nil {
					return "", nameError(src, i, err.Error())
				}
			} else if err := writeNils(&b, arg); err != nil {
				return "", nameError(src, i, err.Error())
			}
			i = end
			continue
		}
		b.WriteString(src[i:j])
		i = j
	}
	return b.String(), nil
}

// nameValue is the number name stands for.
func nameValue(name string) (int64, bool) {
	if v, ok := luaNames[name]; ok {
		return v, true
	}
	v, ok := wire.LuaNames[name]
	return v, ok
}

// argument reads the parenthesised argument that starts at src[at], expands
// it, and returns it with the position after its closing parenthesis.
func argument(src string, at int, used map[string]bool) (string, int, error) {
	if at >= len(src) || src[at] != '(' {
		return "", 0, fmt.Errorf("wants an argument in parentheses")
	}
	depth := 0
	for j := at; j < len(src) && src[j] != '\n'; j++ {
		switch src[j] {
		case '(':
			depth++
		case ')':
			depth--
			if depth == 0 {
				arg, err := expandNames(src[at+1:j], used)
				return arg, j + 1, err
			}
		}
	}
	return "", 0, fmt.Errorf("unclosed argument")
}

// writeFlagTest writes the test of flag bit f of flags byte x: x % 2f >= f,
// or x >= f for the highest bit, which no higher one can follow.
func writeFlagTest(b *strings.Builder, name, x string) error {
	f, ok := wire.LuaFlags[name]
	if !ok {
		return fmt.Errorf("unknown flag %s", name)
	}
	top := true
	for _, g := range wire.LuaFlags {
		top = top && g <= f
	}
	if top {
		fmt.Fprintf(b, "((%s) >= %d)", x, f)
	} else {
		fmt.Fprintf(b, "((%s) %% %d >= %d)", x, 2*f, f)
	}
	return nil
}

// writeNils writes n nils, n a number or a name of one.
func writeNils(b *strings.Builder, n string) error {
	k, err := strconv.Atoi(strings.TrimSpace(n))
	if err != nil || k < 1 {
		return fmt.Errorf("NILS wants a count, not %q", n)
	}
	b.WriteString(strings.Repeat("nil, ", k-1) + "nil")
	return nil
}

// longBracket reports whether s opens a Lua long bracket: [[, [=[, [==[...
func longBracket(s string) bool {
	if !strings.HasPrefix(s, "[") {
		return false
	}
	s = strings.TrimLeft(s[1:], "=")
	return strings.HasPrefix(s, "[")
}

// isCapital reports whether word is written in capitals.
func isCapital(word string) bool {
	return strings.ContainsAny(word, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") && word == strings.ToUpper(word)
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func isWord(c byte) bool {
	return isDigit(c) || c == '_' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
}

// nameError says where in src at lies.
func nameError(src string, at int, msg string) error {
	return fmt.Errorf("line %d: %s", strings.Count(src[:at], "\n")+1, msg)
}

func mark(used map[string]bool, name string) {
	if used != nil {
		used[name] = true
	}
}

// mustExpand expands the names of the code of lua/<file>.lua.
func mustExpand(file, src string) string {
	out, err := expandNames(src, nil)
	if err != nil {
		panic("limits: lua/" + file + ".lua: " + err.Error())
	}
	return out
}
