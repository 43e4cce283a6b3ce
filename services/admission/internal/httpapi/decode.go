package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
	"unicode/utf8"

	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
	"quotaflow/services/admission/internal/decide"
)

// maxID is the longest identifier in bytes (docs/design.md §4).
const maxID = ident.MaxLen

// fieldError is a 400: which field (JSON key, query parameter or header)
// and what is wrong with it.
type fieldError struct {
	field, problem string
}

func (e *fieldError) Error() string { return e.field + ": " + e.problem }

func bad(field, format string, args ...any) *fieldError {
	return &fieldError{field: field, problem: fmt.Sprintf(format, args...)}
}

// admitBody is the JSON body of POST /v1/admit.
type admitBody struct {
	RequestID       string `json:"request_id"`
	Tenant          string `json:"tenant"`
	User            string `json:"user"`
	Plan            string `json:"plan"`
	IP              string `json:"ip"`
	Endpoint        string `json:"endpoint"`
	Model           string `json:"model"`
	EstimatedTokens *int64 `json:"estimated_tokens"`
	InputTokens     *int64 `json:"input_tokens"`
	MaxOutputTokens *int64 `json:"max_output_tokens"`
}

// costFunc weighs input and output tokens of a model (Policy.Cost).
type costFunc func(model string, input, output int64) int64

// decodeAdmit parses and validates a POST /v1/admit body. The Input it
// returns has every rule of docs/design.md §4 checked; RequestID may be empty (the
// caller generates one). Its strings may share body's memory: the caller
// must not modify body afterwards (readBody's is the request's own).
func decodeAdmit(body []byte, cost costFunc) (decide.Input, *fieldError) {
	b, ok := decodeAdmitFast(body)
	if !ok {
		var strict admitBody // on the heap (decodeStrict takes any): only here
		if ferr := decodeStrict(body, &strict); ferr != nil {
			return decide.Input{}, ferr
		}
		b = strict
	}
	in := decide.Input{
		RequestID: b.RequestID, Tenant: b.Tenant, User: b.User, Plan: b.Plan,
		Endpoint: b.Endpoint, Model: b.Model,
	}
	for _, f := range []struct {
		name, v  string
		required bool
	}{
		{"request_id", b.RequestID, false},
		{"tenant", b.Tenant, true},
		{"user", b.User, true},
		{"plan", b.Plan, false},
		{"endpoint", b.Endpoint, true},
		{"model", b.Model, false},
	} {
		if ferr := checkID(f.name, f.v, f.required); ferr != nil {
			return decide.Input{}, ferr
		}
	}
	ip, ferr := parseIP("ip", b.IP)
	if ferr != nil {
		return decide.Input{}, ferr
	}
	in.IP = ip
	c, ferr := tokensCost(b.EstimatedTokens, b.InputTokens, b.MaxOutputTokens, b.Model, cost,
		"estimated_tokens", "input_tokens", "max_output_tokens")
	if ferr != nil {
		return decide.Input{}, ferr
	}
	in.Cost = c
	return in, nil
}

// tokensCost returns the cost: estimated, or input and max output weighed
// by the model; none given costs 0.
func tokensCost(est, input, output *int64, model string, cost costFunc, estName, inName, outName string) (int64, *fieldError) {
	for _, f := range []struct {
		name string
		v    *int64
	}{{estName, est}, {inName, input}, {outName, output}} {
		if f.v != nil && (*f.v < 0 || *f.v > limits.MaxCost) {
			return 0, bad(f.name, "must be a whole number from 0 to %d", int64(limits.MaxCost))
		}
	}
	switch {
	case est != nil && (input != nil || output != nil):
		return 0, bad(estName, "give either %s or %s and %s, not both", estName, inName, outName)
	case est != nil:
		return *est, nil
	case input != nil || output != nil:
		var in, out int64
		if input != nil {
			in = *input
		}
		if output != nil {
			out = *output
		}
		c := cost(model, in, out)
		if c > limits.MaxCost {
			return 0, bad(inName, "weighted cost %d of %s and %s exceeds %d", c, inName, outName, int64(limits.MaxCost))
		}
		return c, nil
	}
	return 0, nil
}

// checkID validates an identifier by the rule of package ident (valid
// UTF-8 of at most maxID bytes without control characters), non-empty when
// required (docs/design.md §4). It runs on every admit, so it must not allocate
// for a valid identifier.
func checkID(field, v string, required bool) *fieldError {
	if v == "" && required {
		return bad(field, "required")
	}
	if err := ident.Check(v); err != nil {
		return &fieldError{field: field, problem: err.Error()}
	}
	return nil
}

// parseIP validates an IPv4 or IPv6 address (no zone) and returns its
// canonical form, so that "::ffff:192.0.2.1" and "192.0.2.1" count as one
// client. Empty stays empty (no IP layer).
func parseIP(field, v string) (string, *fieldError) {
	if v == "" {
		return "", nil
	}
	a, err := netip.ParseAddr(v)
	if err != nil || a.Zone() != "" {
		return "", bad(field, "not an IP address")
	}
	var buf [64]byte // an IPv6 address's longest form is 45 bytes
	if c := a.Unmap().AppendTo(buf[:0]); string(c) != v {
		return string(c), nil
	}
	return v, nil // already canonical: no copy
}

// decodeStrict decodes one JSON object into v: unknown fields, trailing
// data, invalid UTF-8 and unpaired UTF-16 surrogate escapes are rejected
// (encoding/json would silently turn the last two into U+FFFD, letting two
// different identifiers collide).
func decodeStrict(body []byte, v any) *fieldError {
	if len(bytes.TrimSpace(body)) == 0 {
		return bad("body", "empty; want a JSON object")
	}
	if !utf8.Valid(body) {
		return bad("body", "not valid UTF-8")
	}
	if err := checkSurrogates(body); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return bad("body", "unexpected data after the JSON object")
	}
	return nil
}

// jsonError turns an encoding/json error into a fieldError.
func jsonError(err error) *fieldError {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		if te.Field == "" {
			return bad("body", "must be a JSON object")
		}
		switch te.Type.Kind().String() {
		case "string":
			return bad(te.Field, "must be a string")
		case "int64", "ptr":
			return bad(te.Field, "must be a whole number from 0 to %d", int64(limits.MaxCost))
		}
		return bad(te.Field, "has the wrong type (%s)", te.Value)
	case errors.As(err, &se):
		return bad("body", "invalid JSON at byte %d", se.Offset)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return bad("body", "truncated JSON")
	}
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		if s, uerr := strconv.Unquote(name); uerr == nil {
			name = s
		}
		if name == "" {
			return bad("body", `unknown field ""`)
		}
		return bad(sanitizeField(name), "unknown field")
	}
	return bad("body", "invalid JSON")
}

// sanitizeField keeps an unknown field's name printable and short for the
// error message.
func sanitizeField(s string) string {
	if len(s) > 64 {
		s = s[:64]
	}
	return strings.Map(func(r rune) rune {
		if ident.IsControl(r) || r == utf8.RuneError {
			return '?'
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
}

// checkSurrogates rejects \u escapes of UTF-16 surrogates that do not form
// a pair. Backslashes only occur inside strings in valid JSON, so every one
// starts an escape.
func checkSurrogates(b []byte) *fieldError {
	for i := 0; i < len(b); i++ {
		if b[i] != '\\' {
			continue
		}
		if i+1 >= len(b) {
			return nil // the JSON decoder reports it
		}
		if b[i+1] != 'u' {
			i++ // skip the escaped character (it may be a backslash)
			continue
		}
		r, ok := hex4(b, i+2)
		if !ok {
			return nil
		}
		i += 5
		switch {
		case r >= 0xD800 && r <= 0xDBFF:
			if i+6 < len(b) && b[i+1] == '\\' && b[i+2] == 'u' {
				if lo, ok := hex4(b, i+3); ok && lo >= 0xDC00 && lo <= 0xDFFF {
					i += 6
					continue
				}
			}
			return bad("body", "string contains an unpaired UTF-16 surrogate escape")
		case r >= 0xDC00 && r <= 0xDFFF:
			return bad("body", "string contains an unpaired UTF-16 surrogate escape")
		}
	}
	return nil
}

func hex4(b []byte, at int) (rune, bool) {
	if at+4 > len(b) {
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[at:at+4]), 16, 16)
	if err != nil {
		return 0, false
	}
	return rune(v), true
}
