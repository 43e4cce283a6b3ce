package events

import "slices"

// spans records where each object and array of a valid JSON text closes,
// so that the decoder steps over a nested value with a lookup instead of
// walking its bytes once more at each level (a limit snapshot was walked
// by every enclosing object and array: six times, with the check).
type spans struct {
	open []int32 // the offset of each container's '{' or '[', in order
	end  []int32 // just past its '}' or ']'
	last int     // the container found last
	size int     // the text's cap
}

func (s *spans) reset() { s.open, s.end, s.last = s.open[:0], s.end[:0], 0 }

// offset returns where v starts in the text s recorded, v being a slice
// of it (text[i:j], as every slice the decoder takes is): i.
func (s *spans) offset(v []byte) int { return s.size - cap(v) }

// after returns the offset just past the container that opens at off, or
// -1 when none opens there (or s is nil). The decoder mostly asks for the
// container that follows the one it asked for last (the next in the
// text), which after tries before searching.
func (s *spans) after(off int) int {
	if s == nil {
		return -1
	}
	k := s.last + 1
	if k >= len(s.open) || int(s.open[k]) != off {
		var ok bool
		if k, ok = slices.BinarySearch(s.open, int32(off)); !ok {
			return -1
		}
	}
	s.last = k
	return int(s.end[k])
}

// validate reports whether b is one JSON value, exactly as json.Valid
// does (FuzzValidJSON holds it to that), nesting depth bound included,
// recording b's containers in s when s is not nil (reset first; it holds
// them only when validate returns true). json.Valid steps a state machine
// through a function call per byte; this walks the bytes in plain loops,
// and decoding every event a consumer fetches runs it over each message
// first (it was a fifth of the alerter's CPU and a seventh of the
// accounter's in the pipeline).
func validate(b []byte, s *spans) bool {
	if s != nil {
		s.reset()
		s.size = cap(b)
	}
	// open holds the containers around the current position, '{' or '[',
	// innermost last; most events nest three deep. at holds their indexes
	// in s.
	open := make([]byte, 0, 16)
	var at []int32
	if s != nil {
		at = make([]int32, 0, 16)
	}
	i := skipSpace(b, 0)
	for {
		// A value starts at b[i].
		if i >= len(b) {
			return false
		}
		switch b[i] {
		case '{', '[':
			if len(open) == maxNestingDepth {
				return false
			}
			open = append(open, b[i])
			if s != nil {
				at = append(at, int32(len(s.open)))
				s.open, s.end = append(s.open, int32(i)), append(s.end, 0)
			}
			i = skipSpace(b, i+1)
			if i < len(b) && b[i] == open[len(open)-1]+2 { // an empty {} or []
				open = open[:len(open)-1]
				i++
				if s != nil {
					s.end[at[len(at)-1]] = int32(i)
					at = at[:len(at)-1]
				}
				break
			}
			if open[len(open)-1] == '{' {
				if i = memberValue(b, i); i < 0 {
					return false
				}
			}
			continue
		case '"':
			if i = validString(b, i); i < 0 {
				return false
			}
		case 't':
			if i = literal(b, i, "true"); i < 0 {
				return false
			}
		case 'f':
			if i = literal(b, i, "false"); i < 0 {
				return false
			}
		case 'n':
			if i = literal(b, i, "null"); i < 0 {
				return false
			}
		default:
			if i = validNumber(b, i); i < 0 {
				return false
			}
		}
		// A value ended at b[i]: close the containers it ends, then
		// expect the next element or member.
		for {
			i = skipSpace(b, i)
			if len(open) == 0 {
				return i == len(b)
			}
			if i == len(b) {
				return false
			}
			top := open[len(open)-1]
			if b[i] == top+2 { // '}' closes '{', ']' closes '['
				open = open[:len(open)-1]
				i++
				if s != nil {
					s.end[at[len(at)-1]] = int32(i)
					at = at[:len(at)-1]
				}
				continue
			}
			if b[i] != ',' {
				return false
			}
			i = skipSpace(b, i+1)
			if top == '{' {
				if i = memberValue(b, i); i < 0 {
					return false
				}
			}
			break
		}
	}
}

// maxNestingDepth is encoding/json's bound on nested objects and arrays,
// past which json.Valid fails.
const maxNestingDepth = 10000

// memberValue checks a member's key and colon starting at b[i] and returns the
// index of its value (past the spaces), or -1.
func memberValue(b []byte, i int) int {
	if i >= len(b) || b[i] != '"' {
		return -1
	}
	if i = validString(b, i); i < 0 {
		return -1
	}
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	return skipSpace(b, i+1)
}

// validString returns the index just past the string starting at b[i] (a
// quote), or -1 if it is not a valid JSON string: unescaped control
// characters and unknown escapes are not. Bytes of 0x80 and up pass, as
// json.Valid lets them (UTF-8 is checked apart).
func validString(b []byte, i int) int {
	for i = plain(b, i+1); i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			return i + 1
		case c < 0x20:
			return -1
		case c == '\\':
			i++
			if i >= len(b) {
				return -1
			}
			switch b[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if i+4 >= len(b) {
					return -1
				}
				for _, h := range b[i+1 : i+5] {
					if !(h >= '0' && h <= '9' || h >= 'a' && h <= 'f' || h >= 'A' && h <= 'F') {
						return -1
					}
				}
				i += 4
			default:
				return -1
			}
		}
	}
	return -1
}

// literal returns the index past lit at b[i], or -1.
func literal(b []byte, i int, lit string) int {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return -1
	}
	return i + len(lit)
}

// validNumber returns the index past the JSON number at b[i], or -1:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func validNumber(b []byte, i int) int {
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = digits(b, i+1)
	default:
		return -1
	}
	if i < len(b) && b[i] == '.' {
		j := digits(b, i+1)
		if j == i+1 {
			return -1
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digits(b, i)
		if j == i {
			return -1
		}
		i = j
	}
	return i
}

// digits returns the index past the run of digits at b[i].
func digits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}
