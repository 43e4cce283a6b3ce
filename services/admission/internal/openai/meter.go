package openai

import (
	"bytes"
	"encoding/json"
	"strings"
)

// Bounds of a Meter's memory.
const (
	// maxLine is the longest server-sent-event line a Meter holds to
	// read: a responses stream's response.completed repeats the whole
	// output, so it holds about 250k tokens of text. A longer data line
	// passes through and is scanned for its usage and its text's length
	// (usageScan).
	maxLine = 1 << 20
	// textBuffer is how much streamed text a Meter keeps before counting
	// it: a stream that reports its usage (most do) is never tokenized
	// unless its text is longer.
	textBuffer = 64 << 10
	// maxChoices is how many choices' texts are kept apart (text is
	// counted per choice, as the upstream generated it).
	maxChoices = 256
)

// Meter reads an upstream's server-sent-event stream as it passes to the
// client: Feed each chunk as it arrives, in order (chunks may split lines
// and events anywhere), write what Feed returns, call Flush when the
// upstream's stream ends, then Usage.
//
// It finds the usage (chat and completions: the chunk with "usage", which
// stream_options.include_usage asks for; responses: the response.completed,
// response.incomplete or response.failed event) and counts the text the
// stream carries (content, refusal, reasoning, tool-call and legacy
// function-call names and arguments, audio transcripts; responses' *.delta
// events) for when the usage never comes. When built to
// strip, it removes the usage chunk (an event whose data has "choices": []
// and a usage) from what it forwards, and nothing else: everything Feed and
// Flush return, joined, is the stream less that event.
//
// Lines end in LF, CRLF or CR; each data line is read as one JSON value
// (the OpenAI-compatible servers send one an event); a data line longer
// than 1 MiB passes through, is never stripped, and is read a byte at a
// time for its usage and the length of its text, counted at the ratio of
// the text tokenized so far, at least a token per 3 bytes (usageScan). It
// holds at most the current event until its data line is complete (only
// when stripping: otherwise Feed returns its input at once), and at most
// 64 KiB of streamed text. A Meter is not safe for concurrent use; its zero
// value is not usable: NewMeter.
type Meter struct {
	kind  Kind
	strip bool
	text  *counter

	line []byte     // the current line until its end, empty when too long
	long bool       // the current line passed maxLine: only scanned
	scan *usageScan // the scan of a long data line, nil for another
	cr   bool       // the last byte fed was a CR, whose LF may come next

	// While stripping: the bytes of the current event held until its data
	// line tells whether it is the usage chunk, what the event's bytes
	// become, what became of the last line ending (for a split CRLF), and
	// the buffer Feed returns.
	hold  []byte
	state eventState
	eol   eventState // where the last line ending went: held, forwarded or dropped
	out   []byte

	usage    Usage
	reported bool
	choices  map[int][]byte // streamed text not yet counted, per choice
	buffered int            // bytes in choices
	streamed int64          // tokens of the text counted so far
}

type eventState uint8

const (
	undecided eventState = iota // held: no data line yet
	forward                     // passed on as it arrives
	drop                        // the usage chunk, stripped
)

// NewMeter meters a stream of endpoint k for model (its text counted with
// the model's encoding, or at DefaultBytesPerToken for a model without
// one). stripUsage removes the usage chunk of a chat or completions stream:
// set it when the client did not ask for include_usage
// (Request.IncludeUsage false).
func NewMeter(k Kind, model string, stripUsage bool) *Meter {
	m := &Meter{
		kind:    k,
		strip:   stripUsage && (k == Chat || k == Completions),
		text:    newCounter(model, 0),
		choices: make(map[int][]byte),
	}
	m.text.cache = nil // an output is new text: remembering it would evict prompts
	return m
}

// Feed reads the next chunk of the stream and returns what to forward to
// the client: p itself when not stripping, else a buffer of the Meter's
// that is valid until the next call.
func (m *Meter) Feed(p []byte) []byte {
	in := p
	m.out = m.out[:0]
	for len(p) > 0 {
		if m.cr {
			m.cr = false
			if p[0] == '\n' { // the LF of a CRLF split between chunks: it goes where the CR went
				m.put(p[:1], m.eol)
				p = p[1:]
				continue
			}
		}
		i := bytes.IndexAny(p, "\r\n")
		if i < 0 {
			m.partial(p)
			break
		}
		n := 1
		if p[i] == '\r' {
			if i+1 == len(p) {
				m.cr = true
			} else if p[i+1] == '\n' {
				n = 2
			}
		}
		m.partial(p[:i])
		m.end(p[i : i+n])
		p = p[i+n:]
	}
	if !m.strip {
		return in
	}
	return m.out
}

// Flush returns what the Meter still holds when the upstream's stream
// ends: the start of an event whose data line never completed (a client
// discards an unterminated event, but it is the upstream's to send).
func (m *Meter) Flush() []byte {
	if !m.strip || m.state == drop {
		m.hold = m.hold[:0]
		return nil
	}
	out := m.hold
	m.hold = nil
	return out
}

// Usage is the stream's usage: as reported (reported true), else the
// output counted from the streamed text (Input 0: the caller has its own
// count of the prompt, Request.InputTokens).
func (m *Meter) Usage() (u Usage, reported bool) {
	if m.reported {
		return m.usage, true
	}
	m.countText()
	return Usage{Output: m.streamed}, false
}

// partial takes bytes of the current line.
func (m *Meter) partial(b []byte) {
	switch {
	case m.long:
		if m.scan != nil {
			m.scan.feed(b)
		}
	case len(m.line)+len(b) > maxLine:
		m.long = true
		m.scanLong(b)
		m.line = nil
	default:
		m.line = append(m.line, b...)
	}
	if !m.strip {
		return
	}
	switch m.state {
	case forward:
		m.out = append(m.out, b...)
	case undecided:
		m.hold = append(m.hold, b...)
		if len(m.hold) > maxLine { // too long to be a usage chunk
			m.out = append(m.out, m.hold...)
			m.hold, m.state = m.hold[:0], forward
		}
	}
}

// end takes a line's ending: the line is complete.
func (m *Meter) end(eol []byte) {
	line, long, scan := m.line, m.long, m.scan
	m.line, m.long, m.scan = m.line[:0], false, nil
	if !long && len(line) == 0 { // a blank line ends the event
		if m.strip {
			to := max(m.state, forward) // a held event goes out whole
			m.put(m.hold, to)
			m.put(eol, to)
			m.hold, m.state = m.hold[:0], undecided
		}
		return
	}
	data := false
	if !long {
		var usageChunk bool
		data, usageChunk = m.read(line)
		if usageChunk && m.strip && m.state == undecided {
			m.state = drop
		}
	} else if scan != nil && scan.complete() {
		m.readLong(scan)
	}
	if !m.strip {
		return
	}
	if m.state == undecided && (data || long) {
		m.state = forward
		m.out = append(m.out, m.hold...)
		m.hold = m.hold[:0]
	}
	m.put(eol, m.state)
}

// put sends b, part of the current event, where the event's bytes go, and
// notes it for the LF of a CRLF that may come in the next chunk.
func (m *Meter) put(b []byte, to eventState) {
	if !m.strip {
		return
	}
	m.eol = to
	switch to {
	case undecided:
		m.hold = append(m.hold, b...)
	case forward:
		m.out = append(m.out, b...)
	}
}

// read reads a complete line: data tells whether it is a data line,
// usageChunk whether it is the usage chunk of a chat or completions stream.
func (m *Meter) read(line []byte) (data, usageChunk bool) {
	v, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return false, false
	}
	v = bytes.TrimPrefix(v, []byte(" "))
	switch m.kind {
	case Chat, Completions:
		var c streamChunk
		if json.Unmarshal(v, &c) != nil {
			return true, false // [DONE], or not JSON
		}
		for _, ch := range c.Choices {
			m.addText(ch.Index, ch.Text, ch.Delta.Content, ch.Delta.Refusal, ch.Delta.ReasoningContent, ch.Delta.Reasoning)
			for _, tc := range ch.Delta.ToolCalls {
				m.addText(ch.Index, tc.Function.Name, tc.Function.Arguments)
			}
			// The audio's own tokens (base64 data) are not text: its
			// transcript is a lower bound, but never the 0 that releases.
			m.addText(ch.Index, ch.Delta.FunctionCall.Name, ch.Delta.FunctionCall.Arguments, ch.Delta.Audio.Transcript)
		}
		ok := m.report(c.Usage)
		return true, ok && c.Choices != nil && len(c.Choices) == 0
	case Responses:
		var e responseEvent
		if json.Unmarshal(v, &e) != nil {
			return true, false
		}
		switch {
		case settles(e.Type):
			m.report(e.Response.Usage)
		case streamsText(e.Type):
			var s string
			if json.Unmarshal(e.Delta, &s) == nil {
				m.addText(e.OutputIndex, s)
			}
		}
	}
	return true, false
}

// report takes raw as the stream's usage when it is a usage object.
func (m *Meter) report(raw []byte) bool {
	u, ok := usageIn(m.kind, raw)
	if ok {
		m.usage, m.reported = u, true
	}
	return ok
}

// settles: a responses event of this type carries the final usage.
func settles(typ string) bool {
	return typ == "response.completed" || typ == "response.incomplete" || typ == "response.failed"
}

// streamsText: a responses event of this type streams text (audio's
// deltas are base64, not text).
func streamsText(typ string) bool {
	return strings.HasSuffix(typ, ".delta") && typ != "response.audio.delta"
}

// scanLong starts scanning a data line that passes maxLine with b: the
// line so far, in m.line, then b. Only a data line of a metered stream is
// scanned ("data:" and its space pass through the scan as they hold no
// JSON structure).
func (m *Meter) scanLong(b []byte) {
	var head [len("data:")]byte
	n := copy(head[:], m.line)
	copy(head[n:], b)
	if string(head[:]) != "data:" {
		return
	}
	if m.scan = newUsageScan(m.kind); m.scan != nil {
		m.scan.feed(m.line)
		m.scan.feed(b)
	}
}

// readLong takes what the scan of a complete data line past maxLine found:
// its usage, and its text, which was never held, so counted by its length.
func (m *Meter) readLong(s *usageScan) {
	if s.found && (m.kind != Responses || settles(s.typ)) {
		m.report(s.usage)
	}
	if m.kind != Responses || streamsText(s.typ) {
		m.streamed += m.text.extrapolate(s.text.n)
	}
}

// streamChunk is what a Meter reads of a chat or completions chunk.
type streamChunk struct {
	Choices []struct {
		Index int    `json:"index"`
		Text  string `json:"text"`
		Delta struct {
			Content          string `json:"content"`
			Refusal          string `json:"refusal"`
			ReasoningContent string `json:"reasoning_content"` // vLLM, DeepSeek
			Reasoning        string `json:"reasoning"`
			ToolCalls        []struct {
				Function functionDelta `json:"function"`
			} `json:"tool_calls"`
			FunctionCall functionDelta `json:"function_call"` // chat's deprecated "functions"
			Audio        struct {
				Transcript string `json:"transcript"`
			} `json:"audio"`
		} `json:"delta"`
	} `json:"choices"`
	Usage json.RawMessage `json:"usage"`
}

type functionDelta struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// responseEvent is what a Meter reads of a responses stream event.
type responseEvent struct {
	Type        string          `json:"type"`
	OutputIndex int             `json:"output_index"`
	Delta       json.RawMessage `json:"delta"`
	Response    struct {
		Usage json.RawMessage `json:"usage"`
	} `json:"response"`
}

// addText keeps streamed texts of a choice, counted when the buffer is full
// or the usage is asked for.
func (m *Meter) addText(choice int, texts ...string) {
	for _, s := range texts {
		if s == "" {
			continue
		}
		if _, ok := m.choices[choice]; !ok && len(m.choices) == maxChoices {
			m.countText()
		}
		m.choices[choice] = append(m.choices[choice], s...)
		m.buffered += len(s)
		if m.buffered > textBuffer {
			m.countText()
		}
	}
}

func (m *Meter) countText() {
	for i, b := range m.choices {
		m.streamed += m.text.count(string(b))
		delete(m.choices, i)
	}
	m.buffered = 0
}
