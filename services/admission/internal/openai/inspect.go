package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"strconv"
	"unicode/utf8"
	"unsafe"

	"quotaflow/pkg/ident"
)

// Defaults of Options and bounds of a request.
const (
	// DefaultMaxBody holds a long conversation and a few inline images;
	// the text of any model's context window is a fraction of it.
	DefaultMaxBody = 8 << 20
	// DefaultMaxTokens is the output maximum set on a chat or responses
	// request that sets none, so the estimate bounds the actual.
	DefaultMaxTokens = 4096
	// MaxTokens is the largest maximum output a request may ask of one
	// choice: above every model's output window (128k tokens today).
	MaxTokens = 1 << 20
	// MaxChoices bounds n and best_of, as OpenAI does.
	MaxChoices = 128
	// MaxItems bounds messages, prompts, inputs and input items, so that
	// with MaxChoices and MaxTokens an estimate stays below the engine's
	// largest cost (limits.MaxCost, 1e12).
	MaxItems = 4096
	// MediaTokens is counted for each image, audio or file part, in place
	// of its bytes: what gpt-4o charges for a 1024×1024 image at high
	// detail. It is an estimate, not a bound; the actual usage corrects it.
	MediaTokens = 765
	// DefaultReferenceTokens is Options.ReferenceTokens's default: a
	// document of a few pages, or a short conversation kept upstream.
	DefaultReferenceTokens = 8192
	// completionsMaxTokens is the API's own default for /v1/completions,
	// set explicitly when absent so the upstream cannot pick another.
	completionsMaxTokens = 16
	// maxDepth bounds the nesting this package walks in messages and items.
	maxDepth = 32
	// maxValues bounds the objects, arrays and elements of a request's
	// messages or input items, counted before they are decoded: decoded,
	// each costs ~90 bytes or more, and 8 MiB of empty objects would take
	// ~250 MB. MaxItems messages of 32 values each fit.
	maxValues = 32 * MaxItems
	// Chat counting per OpenAI's cookbook ("How to count tokens with
	// tiktoken", gpt-4o and gpt-4 models): each message costs 3 tokens
	// beyond its text, a name 1 more, and every reply is primed with 3.
	tokensPerMessage = 3
	tokensPerName    = 1
	tokensPerReply   = 3
)

// Errors of Inspect: a *FieldError (a 400, naming the field) wraps
// ErrInvalid; a body over Options.MaxBody wraps ErrTooLarge (a 413).
var (
	ErrInvalid  = errors.New("invalid request")
	ErrTooLarge = errors.New("request body too large")
)

// FieldError is an invalid field of a request: Field is its JSON name
// ("messages", "stream_options.include_usage"), or "body" for the body as a
// whole. The message never repeats a value from the body (a repeated key
// of up to 64 bytes at most).
type FieldError struct {
	Field, Problem string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Problem }

// Unwrap makes every FieldError an ErrInvalid.
func (e *FieldError) Unwrap() error { return ErrInvalid }

func bad(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Problem: fmt.Sprintf(format, args...)}
}

// Options tune Inspect; the zero value takes the defaults.
type Options struct {
	MaxBody          int64   // bytes; default DefaultMaxBody
	DefaultMaxTokens int64   // 1..MaxTokens; default DefaultMaxTokens
	BytesPerToken    float64 // fallback for unknown models, MinBytesPerToken..MaxBytesPerToken; default DefaultBytesPerToken
	// ReferenceTokens are counted for each input the body only points to,
	// whose tokens it cannot count: a file part (chat's file, responses'
	// input_file: a file_id or a document's bytes) and a responses
	// request's previous_response_id and conversation. 1..MaxTokens;
	// default DefaultReferenceTokens.
	ReferenceTokens int64
}

// Request is what Inspect learns of a request and the body to send
// upstream.
type Request struct {
	Model  string
	Stream bool
	// IncludeUsage: the client itself asked for stream_options.include_usage
	// (false when not streaming), so its usage chunk must reach it.
	IncludeUsage bool
	// InputTokens is the prompt's tokens counted with the model's encoding
	// (bytes / BytesPerToken for a model without one), chat overhead and
	// MediaTokens per media part included.
	InputTokens int64
	// OutputTokens is the most the upstream may generate: prompts × choices
	// × the maximum per choice (the request's, else the default set in
	// Body). 0 for embeddings.
	OutputTokens int64
	// Body is the request to send upstream: the client's bytes with only
	// the maximum (written into every maximum field an upstream may read)
	// and stream_options.include_usage (when streaming) set. It is the body passed to Inspect when nothing changes.
	Body []byte
}

// Inspect validates a request body of endpoint k, estimates its tokens and
// rewrites it for the upstream. It reads only the fields it needs; the
// others pass through byte for byte. Errors wrap ErrInvalid (a *FieldError)
// or ErrTooLarge.
func Inspect(k Kind, body []byte, o Options) (Request, error) {
	maxBody := o.MaxBody
	if maxBody <= 0 {
		maxBody = DefaultMaxBody
	}
	if int64(len(body)) > maxBody {
		return Request{}, fmt.Errorf("%w: %d bytes, the limit is %d", ErrTooLarge, len(body), maxBody)
	}
	defMax := o.DefaultMaxTokens
	if defMax == 0 {
		defMax = DefaultMaxTokens
	}
	if defMax < 1 || defMax > MaxTokens {
		return Request{}, fmt.Errorf("openai: Options.DefaultMaxTokens %d is outside 1..%d", defMax, MaxTokens)
	}
	refs := o.ReferenceTokens
	if refs == 0 {
		refs = DefaultReferenceTokens
	}
	if refs < 1 || refs > MaxTokens {
		return Request{}, fmt.Errorf("openai: Options.ReferenceTokens %d is outside 1..%d", refs, MaxTokens)
	}
	if bpt := o.BytesPerToken; bpt != 0 && !(bpt >= MinBytesPerToken && bpt <= MaxBytesPerToken) {
		return Request{}, fmt.Errorf("openai: Options.BytesPerToken %v is outside %v..%v", bpt, MinBytesPerToken, MaxBytesPerToken)
	}
	if !utf8.Valid(body) {
		return Request{}, bad("body", "is not valid UTF-8")
	}
	obj, err := parseObject(body)
	if err != nil {
		return Request{}, bad("body", "%v", err)
	}
	in := inspector{obj: obj, refs: refs}
	r := Request{Body: body}
	if r.Model, err = in.model(); err != nil {
		return Request{}, err
	}
	in.c = newCounter(r.Model, o.BytesPerToken)
	if k != Embeddings {
		if r.Stream, err = in.boolean("stream"); err != nil {
			return Request{}, err
		}
	}
	prompts, choices := int64(1), int64(1)
	switch k {
	case Chat:
		r.InputTokens, err = in.chatInput()
		if err == nil {
			choices, err = in.choices()
		}
		if err == nil {
			err = in.maximum(&r, chatMaxField(r.Model), defMax, prompts*choices)
		}
		if err == nil {
			err = in.streamUsage(&r)
		}
	case Completions:
		prompts, r.InputTokens, err = in.prompts("prompt", true)
		if err == nil {
			var suffix int64
			if suffix, err = in.text("suffix"); err == nil {
				r.InputTokens += prompts * suffix
				choices, err = in.choices()
			}
		}
		if err == nil {
			err = in.maximum(&r, "max_tokens", completionsMaxTokens, prompts*choices)
		}
		if err == nil {
			err = in.streamUsage(&r)
		}
	case Embeddings:
		_, r.InputTokens, err = in.prompts("input", false)
	case Responses:
		r.InputTokens, err = in.responsesInput()
		if err == nil {
			err = in.maximum(&r, "max_output_tokens", defMax, 1)
		}
	default:
		return Request{}, fmt.Errorf("openai: unknown endpoint kind %d", k)
	}
	if err != nil {
		return Request{}, err
	}
	r.Body = apply(body, in.edits)
	return r, nil
}

// inspector reads the fields of one request body.
type inspector struct {
	obj   object
	c     *counter
	refs  int64 // Options.ReferenceTokens
	edits []edit
}

func (in *inspector) model() (string, error) {
	v := in.obj.value("model")
	var m string
	if v == nil || json.Unmarshal(v, &m) != nil || m == "" {
		return "", bad("model", "must be a non-empty string")
	}
	if err := ident.Check(m); err != nil {
		return "", bad("model", "%v", err)
	}
	return m, nil
}

func (in *inspector) boolean(key string) (bool, error) {
	var b bool
	if v := in.obj.value(key); v != nil && json.Unmarshal(v, &b) != nil {
		return false, bad(key, "must be true or false")
	}
	return b, nil
}

// whole reads an optional integer field in lo..hi.
func (in *inspector) whole(key string, lo, hi int64) (n int64, set bool, err error) {
	v := in.obj.value(key)
	if v == nil {
		return 0, false, nil
	}
	if json.Unmarshal(v, &n) != nil || n < lo || n > hi {
		return 0, false, bad(key, "must be a whole number from %d to %d", lo, hi)
	}
	return n, true, nil
}

// choices is the completions generated per prompt: n, or best_of when
// larger (the upstream generates best_of and bills them all).
func (in *inspector) choices() (int64, error) {
	n, _, err := in.whole("n", 1, MaxChoices)
	if err != nil {
		return 0, err
	}
	best, _, err := in.whole("best_of", 1, MaxChoices)
	if err != nil {
		return 0, err
	}
	return max(n, best, 1), nil
}

// maxFields are the output maximums an upstream may read on any generating
// endpoint: vLLM prefers max_completion_tokens, TGI and llama.cpp read
// max_tokens, llama.cpp also n_predict (overriding the others) and copies
// a responses body's max_output_tokens into a chat body beside them.
var maxFields = []string{"max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"}

// maximum sets r.OutputTokens from the largest of the maxFields the request
// sets, else def (n_predict's -1 for "no limit" is refused here), and
// writes it into the endpoint's field and every maximum the request names:
// no upstream can generate past the estimate.
func (in *inspector) maximum(r *Request, field string, def, times int64) error {
	per := int64(0)
	set := make(map[string]int64, len(maxFields))
	for _, f := range maxFields {
		n, ok, err := in.whole(f, 1, MaxTokens)
		if err != nil {
			return err
		}
		if ok {
			set[f] = n
		}
		per = max(per, n)
	}
	if per == 0 {
		per = def
	}
	for _, f := range maxFields {
		// A maximum named null is written too: null is absent to the API,
		// but a server that read it otherwise would have no limit.
		_, named := in.obj.find(f)
		if n, ok := set[f]; (named || f == field) && !(ok && n == per) {
			in.edits = append(in.edits, in.obj.set(f, strconv.FormatInt(per, 10)))
		}
	}
	r.OutputTokens = times * per
	return nil
}

// chatMaxField is the maximum to set on a chat request: OpenAI's reasoning
// models refuse max_tokens, and other servers (TGI, older vLLM and
// llama.cpp) know only max_tokens.
func chatMaxField(model string) string {
	for _, f := range []string{"o1", "o3", "o4", "gpt-5"} {
		if inFamily(model, f) {
			return "max_completion_tokens"
		}
	}
	return "max_tokens"
}

// streamUsage asks a streaming chat or completions upstream for its usage
// (stream_options.include_usage) and notes whether the client asked.
func (in *inspector) streamUsage(r *Request) error {
	const field = "stream_options"
	raw := in.obj.value(field)
	if raw == nil {
		if r.Stream {
			in.edits = append(in.edits, in.obj.set(field, `{"include_usage":true}`))
		}
		return nil
	}
	opts, err := parseObject(raw)
	if err != nil {
		return bad(field, "%v", err)
	}
	var asked bool
	if v := opts.value("include_usage"); v != nil && json.Unmarshal(v, &asked) != nil {
		return bad(field+".include_usage", "must be true or false")
	}
	if !r.Stream || asked {
		r.IncludeUsage = r.Stream && asked
		return nil
	}
	e := opts.set("include_usage", "true")
	m, _ := in.obj.find(field)
	e.start += m.start
	e.end += m.start
	in.edits = append(in.edits, e)
	return nil
}

// decode reads an optional field into an any, nil when absent or null.
func (in *inspector) decode(key string) (any, error) {
	raw := in.obj.value(key)
	if raw == nil {
		return nil, nil
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, bad(key, "%v", err)
	}
	return v, nil
}

// items decodes a field of messages or input items, refused unread when
// it holds more than maxValues values.
func (in *inspector) items(key string) (any, error) {
	if countValues(in.obj.value(key)) > maxValues {
		return nil, bad(key, "must hold at most %d objects, arrays and elements", maxValues)
	}
	return in.decode(key)
}

// countValues is, for valid JSON, at least the values decoding it makes:
// its objects and arrays and the commas between elements, outside strings.
// It allocates nothing.
func countValues(raw []byte) int {
	n := 0
	var q quotes
	for _, c := range raw {
		if q.outside(c) && (c == '{' || c == '[' || c == ',') {
			n++
		}
	}
	return n
}

// quotes follows the strings of JSON text read a byte at a time, their
// escapes included, so that no byte within one is taken for structure.
type quotes struct{ inStr, esc bool }

// outside reports whether c, the next byte, is outside every string
// (an opening quote is not).
func (q *quotes) outside(c byte) bool {
	switch {
	case q.esc:
		q.esc = false
	case q.inStr:
		q.esc = c == '\\'
		q.inStr = c != '"'
	case c == '"':
		q.inStr = true
	default:
		return true
	}
	return false
}

// text counts an optional string field.
func (in *inspector) text(key string) (int64, error) {
	v, err := in.decode(key)
	if err != nil || v == nil {
		return 0, err
	}
	s, ok := v.(string)
	if !ok {
		return 0, bad(key, "must be a string")
	}
	return in.c.count(s), nil
}

// tools counts the function definitions a request offers, by their JSON
// text: the model reads them rendered much like it.
func (in *inspector) tools() int64 {
	var n int64
	for _, key := range []string{"tools", "functions"} {
		if v := in.obj.value(key); v != nil {
			n += in.c.count(string(v))
		}
	}
	return n
}

func (in *inspector) chatInput() (int64, error) {
	v, err := in.items("messages")
	if err != nil {
		return 0, err
	}
	msgs, ok := v.([]any)
	if !ok || len(msgs) == 0 || len(msgs) > MaxItems {
		return 0, bad("messages", "must be an array of 1 to %d messages", MaxItems)
	}
	n := int64(tokensPerReply) + in.tools()
	for i, m := range msgs {
		t, err := in.message(m, "messages["+strconv.Itoa(i)+"]")
		if err != nil {
			return 0, err
		}
		n += t
	}
	return n, nil
}

// message counts a chat message or a responses input item: its overhead,
// its name and every text in it (tally).
func (in *inspector) message(v any, field string) (int64, error) {
	m, ok := v.(map[string]any)
	if !ok {
		return 0, bad(field, "must be an object")
	}
	if r, has := m["role"]; has {
		if s, ok := r.(string); !ok || s == "" || len(s) > ident.MaxLen {
			return 0, bad(field+".role", "must be a non-empty string of at most %d bytes", ident.MaxLen)
		}
	}
	n := int64(tokensPerMessage)
	if _, has := m["name"]; has {
		n += tokensPerName
	}
	// Its members, not the message, are tallied: only content parts are
	// media or files, and upstreams ignore a message's own "type", so a
	// message tagged "image_url" must not count its text as one image.
	t, err := in.members(m, 0, field)
	return n + t, err
}

// media are the part types counted as MediaTokens rather than by their
// data (base64 or a URL, which the model does not read as text).
var media = map[string]bool{
	"image_url": true, "input_audio": true, // chat
	"input_image": true, // responses
}

// files are the part types counted as Options.ReferenceTokens: a document
// (a file_id, or a PDF's bytes) whose text only the upstream extracts.
var files = map[string]bool{"file": true, "input_file": true}

// tally counts every string in v but the values of "type" and "id" (tags
// and references, not text the model reads), with MediaTokens for a media
// part.
func (in *inspector) tally(v any, depth int, field string) (int64, error) {
	if depth > maxDepth {
		return 0, bad(field, "nests deeper than %d levels", maxDepth)
	}
	var n int64
	switch v := v.(type) {
	case string:
		return in.c.count(v), nil
	case []any:
		for _, e := range v {
			t, err := in.tally(e, depth+1, field)
			if err != nil {
				return 0, err
			}
			n += t
		}
	case map[string]any:
		t, _ := v["type"].(string)
		switch {
		case media[t]:
			return MediaTokens, nil
		case files[t]:
			return in.refs, nil
		}
		return in.members(v, depth, field)
	}
	return n, nil
}

// members tallies the members of an object at depth but "type" and "id".
func (in *inspector) members(m map[string]any, depth int, field string) (int64, error) {
	var n int64
	for k, e := range m {
		if k == "type" || k == "id" {
			continue
		}
		t, err := in.tally(e, depth+1, field)
		if err != nil {
			return 0, err
		}
		n += t
	}
	return n, nil
}

// prompts reads the prompt of a completion or the input of an embedding:
// a string, an array of strings, an array of token ids or an array of
// arrays of token ids. It returns how many prompts and their tokens.
// Arrays are read from the field's bytes, not decoded: 8 MiB of token ids
// are ~1.4 million of them, which decoded took ~100 MB.
func (in *inspector) prompts(key string, optional bool) (count, tokens int64, err error) {
	raw := in.obj.value(key)
	if raw == nil && optional {
		return 1, 0, nil // the API prompts with <|endoftext|> alone
	}
	if raw != nil && raw[0] == '"' {
		tokens, err = in.text(key)
		return 1, tokens, err
	}
	invalid := bad(key, "must be a string, token ids, or an array of 1 to %d of either", MaxItems)
	if raw == nil || raw[0] != '[' {
		return 0, 0, invalid
	}
	if isNumber(bytes.TrimSpace(raw[1:])[0]) {
		// One prompt of token ids, as long as the body holds: its ids are
		// its input tokens, read undecoded, not prompts for MaxItems.
		n, ok := tokenIDs(raw)
		if !ok {
			return 0, 0, invalid
		}
		return 1, n, nil
	}
	for range elements(raw) {
		count++
	}
	if count == 0 || count > MaxItems {
		return 0, 0, invalid
	}
	for e := range elements(raw) {
		switch e[0] {
		case '"':
			var s string
			if json.Unmarshal(e, &s) != nil {
				return 0, 0, invalid
			}
			tokens += in.c.count(s)
		case '[':
			n, ok := tokenIDs(e)
			if !ok {
				return 0, 0, invalid
			}
			tokens += n
		default:
			return 0, 0, invalid
		}
	}
	return count, tokens, nil
}

// elements yields the elements of raw, a JSON array as parseObject
// checked it, as their bytes. It allocates nothing.
func elements(raw []byte) iter.Seq[[]byte] {
	return func(yield func([]byte) bool) {
		depth, from := 0, 1
		var q quotes
		for i, c := range raw {
			if !q.outside(c) {
				continue
			}
			switch {
			case c == '[', c == '{':
				depth++
			case depth == 1 && (c == ',' || c == ']'):
				// Only an empty array has an empty element.
				if e := bytes.TrimSpace(raw[from:i]); len(e) > 0 && !yield(e) {
					return
				}
				from = i + 1
			case c == ']', c == '}':
				depth--
			}
		}
	}
}

// tokenIDs counts the elements of raw, a JSON array: ok when there is at
// least one and every one is a token id.
func tokenIDs(raw []byte) (n int64, ok bool) {
	for e := range elements(raw) {
		if !tokenID(e) {
			return 0, false
		}
		n++
	}
	return n, n > 0
}

func isNumber(c byte) bool { return c == '-' || c >= '0' && c <= '9' }

// tokenID: raw, a JSON value, is a number that decodes to a whole float64
// from 0 to 2^31-1, as encoding/json decodes it (with strconv.ParseFloat),
// so an id such as 1.0 or 1e3 is accepted as it was when decoded.
func tokenID(raw []byte) bool {
	if !isNumber(raw[0]) {
		return false
	}
	// Parsed in place: ParseFloat keeps no reference to its argument, and a
	// copy of each id would allocate for every element of a long prompt.
	f, err := strconv.ParseFloat(unsafe.String(unsafe.SliceData(raw), len(raw)), 64)
	return err == nil && f >= 0 && f <= 1<<31-1 && f == float64(int64(f))
}

// responsesInput counts instructions and input (a string, or an array of
// items counted as chat messages) of a /v1/responses request, and
// Options.ReferenceTokens for each context the upstream stores
// (previous_response_id, conversation), which is not in the body.
func (in *inspector) responsesInput() (int64, error) {
	n := int64(tokensPerReply) + in.tools()
	for _, key := range []string{"previous_response_id", "conversation"} {
		if in.obj.value(key) != nil {
			n += in.refs
		}
	}
	instr, err := in.text("instructions")
	if err != nil {
		return 0, err
	}
	if instr > 0 {
		n += tokensPerMessage + instr
	}
	v, err := in.items("input")
	if err != nil {
		return 0, err
	}
	switch v := v.(type) {
	case nil:
	case string:
		n += tokensPerMessage + in.c.count("user") + in.c.count(v)
	case []any:
		if len(v) > MaxItems {
			return 0, bad("input", "must have at most %d items", MaxItems)
		}
		for i, item := range v {
			t, err := in.message(item, "input["+strconv.Itoa(i)+"]")
			if err != nil {
				return 0, err
			}
			n += t
		}
	default:
		return 0, bad("input", "must be a string or an array of items")
	}
	return n, nil
}
