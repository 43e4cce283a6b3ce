package openai

// maxUsageObject bounds the usage object a usageScan copies out: OpenAI's,
// with every detail, is a few hundred bytes.
const maxUsageObject = 64 << 10

// usageScan reads a data line too long for a Meter to hold for the one
// thing that decides the charge, its usage: a responses stream's
// response.completed echoes the request's instructions and tools, so the
// caller sets its length, and skipping it would charge the estimate's
// input and the streamed text instead of what the upstream reported.
//
// It reads the JSON a byte at a time in bounded memory: it follows the
// nesting, knows the key of the current member two levels down, and keeps
// only the event's top-level "type" and a copy of the object at path
// (["usage"] in a chat or completions chunk, ["response", "usage"] in a
// responses event). Strings are followed with their escapes, so no text
// inside one (an echoed "usage" in the instructions) is taken for a key.
// It does not validate the JSON: complete tells that the value closed.
type usageScan struct {
	path  []string
	depth int       // containers open
	obj   [3]bool   // the container at depth d ≤ 2 is an object
	key   [3]string // the key of its current member
	atKey bool      // the next string is a key
	q     quotes    // strings and their escapes
	str   []byte    // the current string, at most maxKey bytes
	typ   string    // the top-level "type"
	usage []byte    // the object at path, as copied
	from  int       // the depth the copy started at, 0 when not copying
	found bool      // usage holds a whole object
}

// maxKey is the longest string kept for a key or the type; longer ones
// match nothing.
const maxKey = 64

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
		if was := s.q.inStr; !s.q.outside(c) {
			switch {
			case !was: // its opening quote
				s.str = s.str[:0]
			case !s.q.inStr: // its closing one
				s.endString()
			case len(s.str) <= maxKey:
				s.str = append(s.str, c)
			}
			continue
		}
		switch c {
		case '{', '[':
			if c == '{' && s.atPath() {
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

// endString takes a string that just closed: a key two levels down at
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

// atPath: a value opening here is the member at path.
func (s *usageScan) atPath() bool {
	if s.depth != len(s.path) {
		return false
	}
	for i, k := range s.path {
		if !s.obj[i+1] || s.key[i+1] != k {
			return false
		}
	}
	return true
}

// complete: the line held one whole value (its usage is the upstream's
// last word, not a cut-off line's).
func (s *usageScan) complete() bool { return s.path != nil && s.depth == 0 && !s.q.inStr }
