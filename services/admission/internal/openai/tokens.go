package openai

import (
	"hash/maphash"
	"math"
	"strings"
	"sync"
	"unicode/utf8"

	tiktoken "github.com/pkoukk/tiktoken-go"
	loader "github.com/pkoukk/tiktoken-go-loader"
)

// DefaultBytesPerToken is the fallback ratio for models with no known
// encoding: a text of b bytes counts ⌈b / 3⌉ tokens. OpenAI's rule of thumb
// is 4 bytes of English a token; code and non-Latin scripts take fewer
// bytes a token (Chinese is about 1.5-3), and a smaller ratio errs towards
// reserving more, which the actual usage then gives back. The figures on a
// fixed corpus are in bench/results.md ("The OpenAI codec").
const DefaultBytesPerToken = 3.0

// MinBytesPerToken and MaxBytesPerToken bound Options.BytesPerToken: a
// token is never shorter than a byte nor, in any encoding this package
// knows, near 64 bytes; a ratio outside says the option is wrong (and a
// tiny one would overflow the counts).
const (
	MinBytesPerToken = 0.5
	MaxBytesPerToken = 64.0
)

// The BPE encodings this package knows. Their vocabularies ship inside
// github.com/pkoukk/tiktoken-go-loader, so nothing is downloaded.
const (
	o200k  = "o200k_base"
	cl100k = "cl100k_base"
)

// families maps a model family to its encoding, first match wins, so a
// longer family comes before a shorter one it starts with (gpt-4.1 and
// gpt-4o before gpt-4). A model belongs to a family when its name (after
// the last '/', so "openai/gpt-4o" is gpt-4o) is the family or goes on with
// '-' or '.' ("gpt-4o-mini", "gpt-5.1").
var families = []struct{ name, encoding string }{
	{"gpt-4o", o200k}, {"chatgpt-4o", o200k}, {"gpt-4.1", o200k}, {"gpt-4.5", o200k},
	{"gpt-5", o200k}, {"gpt-oss", o200k}, {"o1", o200k}, {"o3", o200k}, {"o4", o200k},
	{"gpt-4", cl100k}, {"gpt-3.5-turbo", cl100k}, {"gpt-35-turbo", cl100k},
	{"text-embedding-ada-002", cl100k}, {"text-embedding-3", cl100k},
	{"davinci-002", cl100k}, {"babbage-002", cl100k},
}

// encodingOf is the encoding of a model, or "" for one the package does not
// know (counted with the bytes-per-token fallback).
func encodingOf(model string) string {
	for _, f := range families {
		if inFamily(model, f.name) {
			return f.encoding
		}
	}
	return ""
}

// inFamily: model, after the last '/', is family or goes on with '-' or '.'.
func inFamily(model, family string) bool {
	if i := strings.LastIndexByte(model, '/'); i >= 0 {
		model = model[i+1:]
	}
	rest, ok := strings.CutPrefix(model, family)
	return ok && (rest == "" || rest[0] == '-' || rest[0] == '.')
}

// lazyEncoding loads an encoding and its count cache on first use, once:
// building o200k_base takes a fraction of a second and tens of MB, which a
// process that never sees such a model should not pay.
type lazyEncoding struct {
	once  sync.Once
	tk    *tiktoken.Tiktoken
	cache *countCache
	err   error
}

var (
	encodings = map[string]*lazyEncoding{o200k: {}, cl100k: {}}
	// offline points the library at the vocabularies inside the loader
	// module; its default loader downloads them. The library keeps the
	// loader in a global, so it is set once, before any encoding loads.
	offline sync.Once
)

func loadEncoding(name string) (*lazyEncoding, error) {
	e := encodings[name]
	e.once.Do(func() {
		offline.Do(func() { tiktoken.SetBpeLoader(loader.NewOfflineLoader()) })
		e.tk, e.err = tiktoken.GetEncoding(name)
		e.cache = newCountCache()
	})
	return e, e.err
}

// Warm loads every encoding now, so the first request of a model does not
// pay for it. It returns the error of the first encoding that fails to load
// (a broken module download).
func Warm() error {
	for _, name := range []string{o200k, cl100k} {
		if _, err := loadEncoding(name); err != nil {
			return err
		}
	}
	return nil
}

// counter counts the tokens of texts for one model: with its encoding when
// the model has one that loads, else with the bytes-per-token fallback. It
// is not safe for concurrent use (it keeps what it has tokenized so far).
type counter struct {
	tk       *tiktoken.Tiktoken // nil: fallback
	cache    *countCache        // nil: counts are not remembered
	perToken float64
	bytes    int   // tokenized so far, at most exactBytes + segment
	tokens   int64 // their tokens
}

func newCounter(model string, bytesPerToken float64) *counter {
	if bytesPerToken <= 0 {
		bytesPerToken = DefaultBytesPerToken
	}
	c := &counter{perToken: bytesPerToken}
	if name := encodingOf(model); name != "" {
		// An encoding that fails to load (it cannot here: the vocabulary is
		// compiled in) degrades to the fallback rather than refusing work.
		if e, err := loadEncoding(name); err == nil {
			c.tk, c.cache = e.tk, e.cache
		}
	}
	return c
}

// segment is the most bytes counted in one call to the tokenizer. The
// library's byte-pair merge is quadratic in the length of a piece and its
// regular expressions backtrack, so a long run of letters with no space
// (base64, Chinese, a minified blob) would take seconds a megabyte; cut
// into segments, the work grows linearly with the text.
const segment = 256

// exactBytes bounds the text one counter tokenizes: the library runs at
// 2.4-4.8 MB/s of CPU (bench/results.md, "The OpenAI codec"), so 64 KiB
// costs about 25 ms. A longer text's rest is estimated at the ratio of tokens
// to bytes of what was tokenized (the same conversation, so the same mix
// of prose, code and scripts), but never below minTokensPerByte.
const exactBytes = 64 << 10

// minTokensPerByte floors the extrapolation's ratio, since what was
// tokenized first is the caller's to choose: after 64 KiB of blanks (128
// bytes a token) a prompt would cost almost nothing. It is the bytes
// fallback's ratio, which over-reserves prose, code and Chinese by 4-41 %
// and under-reserves none of them (bench/results.md, "The OpenAI codec"),
// so an honest long text is not under-counted; the densest text (a token
// a byte) is still counted at a third at least.
const minTokensPerByte = 1 / DefaultBytesPerToken

// count is the number of tokens of s. Within exactBytes it equals the
// tokenizer on the whole text when every run of segment bytes holds a cut
// that no token crosses (a single space between two non-space ASCII
// characters, or a newline before an ASCII letter or digit), as prose and
// code do; elsewhere (a long run with no such cut: Chinese, base64) it cuts
// at a character boundary and may count a token more or less per cut.
func (c *counter) count(s string) int64 {
	if c.tk == nil {
		return c.fallback(len(s))
	}
	if c.cache != nil && len(s) >= minCached && c.bytes+len(s) <= exactBytes {
		// Counted whole, so the count is the same whether remembered or not.
		h := maphash.String(c.cache.seed, s)
		n, ok := c.cache.get(h)
		if !ok {
			n = c.segments(s)
			c.cache.put(h, n)
			return n
		}
		c.bytes += len(s)
		c.tokens += n
		return n
	}
	return c.segments(s)
}

// segments counts s segment by segment within the budget, the rest by
// extrapolation.
func (c *counter) segments(s string) int64 {
	var n int64
	for s != "" && c.bytes < exactBytes {
		i := len(s)
		if i > segment {
			i = cut(s[:segment+1])
		}
		t := int64(len(c.tk.EncodeOrdinary(s[:i])))
		c.bytes += i
		c.tokens += t
		n += t
		s = s[i:]
	}
	return n + c.extrapolate(len(s))
}

// extrapolate counts text of n bytes that is not tokenized: at the ratio
// of tokens to bytes of what was (the same conversation or answer), but
// at least minTokensPerByte, which is all a counter that tokenized nothing
// (or has no encoding) has.
func (c *counter) extrapolate(n int) int64 {
	ratio := minTokensPerByte
	if c.bytes > 0 {
		ratio = max(float64(c.tokens)/float64(c.bytes), ratio)
	}
	return int64(math.Ceil(float64(n) * ratio))
}

// fallback counts a text of the given bytes at perToken, at most
// MaxTokens: no model reads more in one text, and the bound keeps the sum
// of a request's counts in range whatever the option's ratio.
func (c *counter) fallback(bytes int) int64 {
	return int64(min(math.Ceil(float64(bytes)/c.perToken), MaxTokens))
}

// cut is where count splits s (len(s) > 1): the last offset i > 0 at which
// a token starts whatever the encoding, else the last rune start.
func cut(s string) int {
	for i := len(s) - 2; i > 0; i-- {
		switch {
		case s[i] == ' ' && word(s[i-1]) && word(s[i+1]):
			return i // " word" starts a token in every encoding
		case s[i-1] == '\n' && alnum(s[i]):
			return i // a newline run ends before a letter or digit
		}
	}
	i := len(s) - 1
	for i > 1 && !utf8.RuneStart(s[i]) {
		i--
	}
	return i
}

// word: an ASCII character that is not white space.
func word(b byte) bool { return b > ' ' && b < utf8.RuneSelf }

func alnum(b byte) bool {
	return b >= '0' && b <= '9' || b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z'
}
