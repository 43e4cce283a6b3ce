package openai

import "unicode/utf8"

// maxUsageObject bounds the usage object a usageScan copies out: OpenAI's,
// with every detail, is a few hundred bytes.
const maxUsageObject = 64 << 10

// usageScan reads a data line too long for a Meter to hold for what decides
// the charge. Its usage: a responses stream's response.completed echoes
// the request's instructions and tools, so the caller sets its length, and
// skipping it would charge the estimate's input and the streamed text
// instead of what the upstream reported. And the length of its text, for
// when no usage comes: skipped, a huge delta (a tool-call argument the
// caller had the model write) would be streamed for nothing.
//
// It reads the JSON a byte at a time in bounded memory: it follows the
// nesting, knows the key of the current member maxNamed levels down, and
// keeps only the event's top-level "type", a copy of the object at path
// (["usage"] in a chat or completions chunk, ["response", "usage"] in a
// responses event) and how many bytes the strings at texts decode to.
// Strings are followed with their escapes, so no text inside one (an
// echoed "usage" in the instructions) is taken for a key. It does not
// validate the JSON: complete tells that the value closed.
type usageScan struct {
	path   []string
	texts  [][]string
	depth  int                  // containers open
	obj    [maxNamed + 1]bool   // the container at depth d ≤ maxNamed is an object
	key    [maxNamed + 1]string // the key of its current member
	atKey  bool                 // the next string is a key
	q      quotes               // strings and their escapes
	str    []byte               // the current string, at most maxKey bytes
	inText bool                 // the current string is at one of texts
	text   decodedLen           // of the strings at texts
	typ    string               // the top-level "type"
	usage  []byte               // the object at path, as copied
	from   int                  // the depth the copy started at, 0 when not copying
	found  bool                 // usage holds a whole object
}

// Where a Meter's read takes text from ("*": each element of an array): a
// chat or completions chunk's, and a responses event's (the event's type
// tells whether it is text: streamsText).
var (
	chunkTexts = [][]string{
		{"choices", "*", "text"},
		{"choices", "*", "delta", "content"},
		{"choices", "*", "delta", "refusal"},
		{"choices", "*", "delta", "reasoning_content"},
		{"choices", "*", "delta", "reasoning"},
		{"choices", "*", "delta", "tool_calls", "*", "function", "name"},
		{"choices", "*", "delta", "tool_calls", "*", "function", "arguments"},
		{"choices", "*", "delta", "function_call", "name"},
		{"choices", "*", "delta", "function_call", "arguments"},
		{"choices", "*", "delta", "audio", "transcript"},
	}
	eventTexts = [][]string{{"delta"}}
)

// maxNamed is the deepest member a usageScan looks for: a tool call's
// arguments.
const maxNamed = 7

// maxKey is the longest string kept for a key or the type; longer ones
// match nothing.
const maxKey = 64

// newUsageScan scans a data line of a stream of endpoint k, nil for one
// that does not stream.
func newUsageScan(k Kind) *usageScan {
	switch k {
	case Chat, Completions:
		return &usageScan{path: []string{"usage"}, texts: chunkTexts}
	case Responses:
		return &usageScan{path: []string{"response", "usage"}, texts: eventTexts}
	}
	return nil
}

func (s *usageScan) feed(b []byte) {
	if s.path == nil {
		return
	}
	for _, c := range b {
		if s.from > 0 {
			if len(s.usage) == maxUsageObject {
				s.from, s.usage = 0, nil // not a usage: given up
			} else {
				s.usage = append(s.usage, c)
			}
		}
		escaped := s.q.esc
		if was := s.q.inStr; !s.q.outside(c) {
			switch {
			case !was: // its opening quote
				s.str, s.inText = s.str[:0], !s.atKey && s.atText()
				s.text.hex = 0 // what a string cut inside an escape left
			case !s.q.inStr: // its closing one
				s.endString()
			default:
				if len(s.str) <= maxKey {
					s.str = append(s.str, c)
				}
				if s.inText {
					s.text.add(c, escaped)
				}
			}
			continue
		}
		switch c {
		case '{', '[':
			if c == '{' && s.at(s.path) {
				s.from, s.usage, s.found = s.depth+1, append(s.usage[:0], c), false
			}
			s.depth++
			if s.depth < len(s.obj) {
				s.obj[s.depth], s.key[s.depth] = c == '{', ""
			}
			s.atKey = c == '{'
		case '}', ']':
			if s.depth == 0 {
				s.path = nil // not JSON: nothing more is read
				return
			}
			s.depth--
			if s.from > 0 && s.depth < s.from {
				s.from, s.found = 0, true
			}
			s.atKey = false
		case ',':
			s.atKey = s.depth < len(s.obj) && s.obj[s.depth]
		case ':':
			s.atKey = false
		}
	}
}

// endString takes a string that just closed: a key maxNamed levels down at
// most, or the top-level type's value.
func (s *usageScan) endString() {
	v := string(s.str)
	if len(s.str) > maxKey {
		v = "" // matches no key the scan looks for
	}
	switch {
	case s.atKey && s.depth < len(s.key):
		s.key[s.depth] = v
	case s.depth == 1 && s.key[1] == "type":
		s.typ = v
	}
}

// at: a value opening here is the member at p.
func (s *usageScan) at(p []string) bool {
	if s.depth != len(p) {
		return false
	}
	for i, k := range p {
		if d := i + 1; s.obj[d] == (k == "*") || s.obj[d] && s.key[d] != k {
			return false
		}
	}
	return true
}

// atText: a value opening here is at one of texts.
func (s *usageScan) atText() bool {
	for _, p := range s.texts {
		if s.at(p) {
			return true
		}
	}
	return false
}

// complete: the line held one whole value (its usage is the upstream's
// last word, not a cut-off line's).
func (s *usageScan) complete() bool { return s.path != nil && s.depth == 0 && !s.q.inStr }

// decodedLen counts the bytes JSON strings decode to, fed the bytes between
// their quotes: an escape counts as the UTF-8 of the character it stands
// for, a \u surrogate as 2 (a pair is 4).
type decodedLen struct {
	n   int
	hex int  // \u digits still to come
	cp  rune // their value so far
}

// add counts c, escaped when it follows an escaping backslash.
func (d *decodedLen) add(c byte, escaped bool) {
	switch {
	case d.hex > 0:
		d.cp = d.cp<<4 | unhex(c)
		if d.hex--; d.hex == 0 {
			d.n += runeLen(d.cp)
		}
	case escaped && c == 'u':
		d.hex, d.cp = 4, 0
	case escaped || c != '\\':
		d.n++
	}
}

// runeLen is the UTF-8 length of a \u escape's character: 2 for a
// surrogate, half of a pair's 4.
func runeLen(r rune) int {
	if n := utf8.RuneLen(r); n > 0 {
		return n
	}
	return 2
}

// unhex is the value of a hexadecimal digit (0 for another byte: the scan
// does not validate).
func unhex(c byte) rune {
	switch l := c | 0x20; {
	case c >= '0' && c <= '9':
		return rune(c - '0')
	case l >= 'a' && l <= 'f':
		return rune(l-'a') + 10
	}
	return 0
}
