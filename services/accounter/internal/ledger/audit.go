package ledger

import (
	"errors"
	"fmt"
)

// ErrUnreadable marks an event whose JSON the documented audit read,
// convert_from(event, 'UTF8')::jsonb (an actual's: actual_event), would
// refuse (docs/design.md §6): one such row would fail every audit query
// over its range, so the accounter dead-letters the event instead of
// storing it.
var ErrUnreadable = errors.New("the audit read (jsonb) cannot parse the event")

// Postgres's numeric, which holds a jsonb number, has at most this many
// digits before the decimal point and after it.
const (
	maxNumericWeight = 131072
	maxNumericScale  = 16383
)

// CheckAudit reports (wrapping ErrUnreadable) what in b, an event already
// checked to be valid UTF-8 and JSON, jsonb cannot hold: a \u0000 escape
// (text holds no NUL), a surrogate escape not in a high-low pair, or a
// number beyond numeric's range. Most events hold no escape and only
// small numbers; this is one pass over the bytes.
func CheckAudit(b []byte) error {
	for i := 0; i < len(b); {
		switch c := b[i]; {
		case c == '"':
			n, err := checkString(b[i+1:])
			if err != nil {
				return fmt.Errorf("%w: byte %d: %v", ErrUnreadable, i+1+n, err)
			}
			i += n + 2
		case c == '-' || '0' <= c && c <= '9':
			n, err := checkNumber(b[i:])
			if err != nil {
				return fmt.Errorf("%w: byte %d: %v", ErrUnreadable, i, err)
			}
			i += n
		default:
			i++
		}
	}
	return nil
}

// checkString checks the string at the start of b (after its opening
// quote) and returns its length up to its closing quote, or where it is
// wrong.
func checkString(b []byte) (int, error) {
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			return i, nil
		case '\\':
			if i+1 >= len(b) {
				return i, errors.New("unterminated string")
			}
			if b[i+1] != 'u' {
				i++
				continue
			}
			r, ok := hex4(b[i+2:])
			switch {
			case !ok:
				return i, errors.New(`malformed \u escape`)
			case r == 0:
				return i, errors.New(`\u0000: text cannot hold a NUL`)
			case 0xDC00 <= r && r < 0xE000:
				return i, errors.New("a low surrogate escape without its high one")
			case 0xD800 <= r && r < 0xDC00:
				if len(b) < i+12 || b[i+6] != '\\' || b[i+7] != 'u' {
					return i, errors.New("a high surrogate escape without its low one")
				}
				if lo, ok := hex4(b[i+8:]); !ok || lo < 0xDC00 || lo >= 0xE000 {
					return i, errors.New("a high surrogate escape without its low one")
				}
				i += 11
			default:
				i += 5
			}
		}
	}
	return len(b), errors.New("unterminated string")
}

// hex4 is the value of the four hex digits at the start of b.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// checkNumber checks the JSON number at the start of b against numeric's
// range, counting every digit written (leading zeros too, so it may refuse
// a number numeric would hold, never the reverse), and returns its length.
func checkNumber(b []byte) (int, error) {
	i := 0
	if b[i] == '-' {
		i++
	}
	digits := func() int {
		s := i
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
		return i - s
	}
	whole, frac, exp := digits(), 0, 0
	if i < len(b) && b[i] == '.' {
		i++
		frac = digits()
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		neg := i < len(b) && b[i] == '-'
		if i < len(b) && (b[i] == '-' || b[i] == '+') {
			i++
		}
		for ; i < len(b) && '0' <= b[i] && b[i] <= '9'; i++ {
			exp = min(exp*10+int(b[i]-'0'), 1<<30) // far past any limit
		}
		if neg {
			exp = -exp
		}
	}
	if whole+exp > maxNumericWeight || frac-exp > maxNumericScale {
		return i, fmt.Errorf("number %.40s is beyond Postgres numeric's range", b[:i])
	}
	return i, nil
}
