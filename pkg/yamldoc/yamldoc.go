// Package yamldoc reads a configuration file that must hold exactly one
// YAML document (the policy, the API tokens file) into its node tree, so
// that the file's own parser can walk it and name each mistake by its path.
package yamldoc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"
)

// ErrEmpty means the input holds no YAML document: nothing, or only
// comments.
var ErrEmpty = errors.New("empty")

// Decode parses data into its document node. what names the input in the
// errors: "<what> is empty" (wrapping ErrEmpty), "parse <what>: <the YAML
// error with its line>", and "<what> holds more than one YAML document
// (line n)", since a second document would otherwise be ignored in silence.
func Decode(data []byte, what string) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s is %w", what, ErrEmpty)
		}
		return nil, fmt.Errorf("parse %s: %w", what, err)
	}
	var next yaml.Node
	if err := dec.Decode(&next); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", what, err)
		}
		return nil, fmt.Errorf("%s holds more than one YAML document (line %d)", what, next.Line)
	}
	return &doc, nil
}

// ReadFile reads the file at path, at most max+1 bytes: enough for the
// caller to tell that it is larger than max without reading a wrong path (a
// log, a device) into memory. Errors are the os package's, for the caller
// to wrap with the setting that named the path.
func ReadFile(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max+1))
}
