package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
)

// member is one "key": value of a JSON object, with the value's offsets in
// the text the object was parsed from.
type member struct {
	key        string
	start, end int
}

// object is a JSON object's members in order, keys exact (encoding/json
// would match "MODEL" to model: an upstream would not) and unique (a
// repeated key is refused: this package and the upstream might read
// different ones), and the offset of its closing brace.
type object struct {
	text    []byte
	members []member
	close   int
}

var errNotObject = errors.New("must be a JSON object")

// parseObject reads text, which must be one JSON object and nothing else.
func parseObject(text []byte) (object, error) {
	o := object{text: text}
	d := json.NewDecoder(bytes.NewReader(text))
	if t, err := d.Token(); err != nil || t != json.Delim('{') {
		return o, errNotObject
	}
	for d.More() {
		t, err := d.Token()
		if err != nil {
			return o, syntax(err)
		}
		key := t.(string) // the decoder gives a string in a key's place or an error
		if _, dup := o.find(key); dup {
			if len(key) > maxQuoted {
				return o, errors.New("repeats a field")
			}
			return o, errors.New("repeats the field " + strconv.Quote(key))
		}
		var v json.RawMessage
		if err := d.Decode(&v); err != nil {
			return o, syntax(err)
		}
		end := int(d.InputOffset())
		o.members = append(o.members, member{key: key, start: end - len(v), end: end})
	}
	if _, err := d.Token(); err != nil {
		return o, syntax(err)
	}
	o.close = int(d.InputOffset()) - 1
	if _, err := d.Token(); err != io.EOF {
		return o, errors.New("has data after the JSON object")
	}
	return o, nil
}

// maxQuoted is the longest key an error repeats.
const maxQuoted = 64

// syntax is a decoder's error without the character it quotes, so that an
// error never repeats the body.
func syntax(err error) error {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Errorf("is not valid JSON at byte %d", se.Offset)
	}
	return errors.New("is not valid JSON: it ends early")
}

func (o object) find(key string) (member, bool) {
	for _, m := range o.members {
		if m.key == key {
			return m, true
		}
	}
	return member{}, false
}

// value is the raw value of key, nil when absent or null: every optional
// field of the API treats null as absent.
func (o object) value(key string) []byte {
	m, ok := o.find(key)
	if !ok {
		return nil
	}
	v := o.text[m.start:m.end]
	if string(v) == "null" {
		return nil
	}
	return v
}

// edit is a change to an object's text: replace [start, end) with text.
type edit struct {
	start, end int
	text       string
}

// set is the edit that makes key's value raw: the old value replaced, or
// the member added after the last one.
func (o object) set(key, raw string) edit {
	if m, ok := o.find(key); ok {
		return edit{m.start, m.end, raw}
	}
	if n := len(o.members); n > 0 {
		at := o.members[n-1].end
		return edit{at, at, "," + strconv.Quote(key) + ":" + raw}
	}
	return edit{o.close, o.close, strconv.Quote(key) + ":" + raw}
}

// apply returns text with edits made, which must not overlap; text itself
// when there are none.
func apply(text []byte, edits []edit) []byte {
	if len(edits) == 0 {
		return text
	}
	slices.SortStableFunc(edits, func(a, b edit) int { return a.start - b.start })
	n := len(text)
	for _, e := range edits {
		n += len(e.text) - (e.end - e.start)
	}
	out := make([]byte, 0, n)
	at := 0
	for _, e := range edits {
		out = append(out, text[at:e.start]...)
		out = append(out, e.text...)
		at = e.end
	}
	return append(out, text[at:]...)
}
