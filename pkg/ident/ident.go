package ident

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// MaxLen is the longest identifier, in bytes. 256 holds any realistic id
// (a UUID is 36, an email address at most 254) while keeping Redis keys,
// event ids' inputs and ledger rows small.
const MaxLen = 256

// The problems Check reports. Their text is the "<what is wrong>" part of
// a boundary's "<field>: <what is wrong>" message.
var (
	// ErrTooLong: more than MaxLen bytes.
	ErrTooLong = fmt.Errorf("longer than %d bytes", MaxLen)
	// ErrInvalidUTF8: not valid UTF-8.
	ErrInvalidUTF8 = errors.New("not valid UTF-8")
	// ErrControl: holds a control character (IsControl).
	ErrControl = errors.New("contains a control character")
)

// Check returns nil when v is a valid identifier (or empty), else
// ErrTooLong, ErrInvalidUTF8 or ErrControl, checked in that order. It does
// not allocate; printable ASCII, what nearly every identifier is, takes a
// single pass over the bytes.
func Check(v string) error {
	if len(v) > MaxLen {
		return ErrTooLong
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c >= 0x7f {
			return checkRest(v[i:])
		}
	}
	return nil
}

// checkRest is Check's path for a string that is not printable ASCII
// from its first byte on.
func checkRest(v string) error {
	if !utf8.ValidString(v) {
		return ErrInvalidUTF8
	}
	for _, r := range v {
		if IsControl(r) {
			return ErrControl
		}
	}
	return nil
}

// IsControl reports whether r is a control character, Unicode category
// Cc: U+0000–U+001F and U+007F–U+009F (the same set as unicode.IsControl).
func IsControl(r rune) bool {
	return r < 0x20 || r >= 0x7f && r <= 0x9f
}
