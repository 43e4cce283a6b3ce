package httpapi

import (
	"unicode/utf8"
	"unsafe"
)

// decodeAdmitFast decodes the body every gateway sends — one flat object of
// admitBody's exact keys, string values without escapes, whole numbers for
// the token fields — without encoding/json's reflection, which was a tenth
// of the HTTP layer's cost. ok is false for anything else (escapes, null,
// other key spellings, unknown keys, any syntax error, invalid UTF-8):
// decodeStrict then decides, with its error messages. What this accepts,
// decodeStrict accepts with the same result (FuzzDecodeAdmitFast). Its
// strings share body's memory (no copy, no allocation per field), so the
// caller must not modify body afterwards.
func decodeAdmitFast(body []byte) (b admitBody, ok bool) {
	if !utf8.Valid(body) {
		return b, false
	}
	p := fastParser{b: unsafe.String(unsafe.SliceData(body), len(body))}
	if !p.byte('{') {
		return b, false
	}
	if p.skip(); p.peek('}') {
		p.i++
		return b, p.end()
	}
	for {
		key, ok := p.str()
		if !ok || !p.byte(':') {
			return b, false
		}
		p.skip()
		var sv *string
		var nv **int64
		switch key {
		case "request_id":
			sv = &b.RequestID
		case "tenant":
			sv = &b.Tenant
		case "user":
			sv = &b.User
		case "plan":
			sv = &b.Plan
		case "ip":
			sv = &b.IP
		case "endpoint":
			sv = &b.Endpoint
		case "model":
			sv = &b.Model
		case "estimated_tokens":
			nv = &b.EstimatedTokens
		case "input_tokens":
			nv = &b.InputTokens
		case "max_output_tokens":
			nv = &b.MaxOutputTokens
		default:
			return b, false
		}
		if sv != nil {
			if *sv, ok = p.str(); !ok {
				return b, false
			}
		} else {
			n, ok := p.int()
			if !ok {
				return b, false
			}
			*nv = &n
		}
		p.skip()
		switch {
		case p.peek(','):
			p.i++
			p.skip()
		case p.peek('}'):
			p.i++
			return b, p.end()
		default:
			return b, false
		}
	}
}

// fastParser reads the simple JSON decodeAdmitFast accepts.
type fastParser struct {
	b string
	i int
}

func (p *fastParser) skip() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *fastParser) peek(c byte) bool { return p.i < len(p.b) && p.b[p.i] == c }

// byte skips white space and consumes c.
func (p *fastParser) byte(c byte) bool {
	p.skip()
	if !p.peek(c) {
		return false
	}
	p.i++
	return true
}

// end reports whether only white space is left.
func (p *fastParser) end() bool {
	p.skip()
	return p.i == len(p.b)
}

// str reads a string without escapes or control characters.
func (p *fastParser) str() (string, bool) {
	if !p.peek('"') {
		return "", false
	}
	start := p.i + 1
	for j := start; j < len(p.b); j++ {
		switch c := p.b[j]; {
		case c == '"':
			p.i = j + 1
			return p.b[start:j], true
		case c == '\\' || c < 0x20:
			return "", false
		}
	}
	return "", false
}

// int reads an integer literal of at most 18 digits (no fraction or
// exponent), which always fits an int64.
func (p *fastParser) int() (int64, bool) {
	neg := p.peek('-')
	if neg {
		p.i++
	}
	start := p.i
	var n int64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		n = n*10 + int64(p.b[p.i]-'0')
		p.i++
	}
	digits := p.i - start
	if digits == 0 || digits > 18 || digits > 1 && p.b[start] == '0' {
		return 0, false
	}
	if p.i < len(p.b) {
		switch p.b[p.i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	if neg {
		n = -n
	}
	return n, true
}
