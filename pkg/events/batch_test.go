package events

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestBatchRoundTrip(t *testing.T) {
	evs := examples()
	b, err := EncodeBatch(evs)
	if err != nil {
		t.Fatal(err)
	}
	got, errs, raw, err := DecodeBatch(b)
	if err != nil {
		t.Fatalf("DecodeBatch = %v", err)
	}
	if len(got) != len(evs) || len(errs) != len(evs) || len(raw) != len(evs) {
		t.Fatalf("DecodeBatch gave %d events, %d errors, %d raw; want %d each", len(got), len(errs), len(raw), len(evs))
	}
	for i := range evs {
		single, _ := Encode(evs[i])
		if errs[i] != nil || !reflect.DeepEqual(got[i], evs[i]) || !bytes.Equal(raw[i], single) {
			t.Errorf("batch[%d] = %+v, %v, %s; want %+v as encoded alone", i, got[i], errs[i], raw[i], evs[i])
		}
	}
	if n := BatchSize(len(evs), len(b)-len(evs)-1); n != len(b) {
		t.Errorf("BatchSize = %d, want %d", n, len(b))
	}
}

// A bad element fails alone; the others decode.
func TestDecodeBatchBadElement(t *testing.T) {
	evs := examples()[:3]
	var parts [][]byte
	for _, ev := range evs {
		b, _ := Encode(ev)
		parts = append(parts, b)
	}
	bad := bytes.Replace(parts[1], []byte(`"specversion":"1.0"`), []byte(`"specversion":"0.3"`), 1)
	if bytes.Equal(bad, parts[1]) {
		t.Fatal("test event has no specversion to break")
	}
	b := AppendBatch(nil, [][]byte{parts[0], bad, []byte(`42`), parts[2]})
	got, errs, raw, err := DecodeBatch(b)
	if err != nil {
		t.Fatalf("DecodeBatch = %v", err)
	}
	want := []bool{true, false, false, true}
	for i, ok := range want {
		if (errs[i] == nil) != ok {
			t.Errorf("batch[%d] error = %v, want ok=%v", i, errs[i], ok)
		}
		if errs[i] != nil && !errors.Is(errs[i], ErrInvalid) {
			t.Errorf("batch[%d] error %v does not wrap ErrInvalid", i, errs[i])
		}
	}
	if !reflect.DeepEqual(got[0], evs[0]) || !reflect.DeepEqual(got[3], evs[2]) {
		t.Errorf("good elements = %+v, %+v", got[0], got[3])
	}
	if !bytes.Equal(raw[1], bad) || string(raw[2]) != "42" {
		t.Errorf("raw = %q, %q", raw[1], raw[2])
	}
}

func TestDecodeBatchWhole(t *testing.T) {
	one, _ := Encode(examples()[0])
	many := AppendBatch(nil, slicesRepeat(one, MaxBatchEvents+1))
	for name, b := range map[string][]byte{
		"empty input":  nil,
		"not json":     []byte(`[{`),
		"object":       one,
		"empty array":  []byte(`[]`),
		"bad utf8":     []byte("[\"\xff\"]"),
		"too many":     many,
		"too large":    []byte("[" + strings.Repeat(" ", MaxBatchSize) + "1]"),
		"trailing":     append(AppendBatch(nil, [][]byte{one}), '1'),
		"array in arr": []byte(`[[]]`), // decodes; the element fails
	} {
		t.Run(name, func(t *testing.T) {
			evs, errs, _, err := DecodeBatch(b)
			if name == "array in arr" {
				if err != nil || len(errs) != 1 || errs[0] == nil {
					t.Fatalf("DecodeBatch = %v, %v; want one bad element", errs, err)
				}
				return
			}
			if err == nil || !errors.Is(err, ErrInvalid) || evs != nil || errs != nil {
				t.Fatalf("DecodeBatch = %v, %v, %v; want an ErrInvalid for the whole batch", evs, errs, err)
			}
		})
	}
}

func slicesRepeat(b []byte, n int) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = b
	}
	return out
}

func TestEncodeBatchRejects(t *testing.T) {
	evs := examples()
	evs[2].ID = ""
	if _, err := EncodeBatch(evs); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "batch[2]") {
		t.Errorf("EncodeBatch(bad event 2) = %v, want ErrInvalid naming batch[2]", err)
	}
	if _, err := EncodeBatch(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("EncodeBatch(nil) = %v, want ErrInvalid", err)
	}
}

func TestBatchID(t *testing.T) {
	a := BatchID([]string{"x", "y"})
	for _, other := range []string{BatchID([]string{"y", "x"}), BatchID([]string{"xy"}), BatchID([]string{"x", "y", ""})} {
		if a == other {
			t.Errorf("BatchID collision: %q", a)
		}
	}
	if a != BatchID([]string{"x", "y"}) {
		t.Error("BatchID is not deterministic")
	}
	// Never an event id: event ids hold no space.
	c := newChecker()
	c.eventID("id", a)
	if c.err() == nil {
		t.Errorf("BatchID %q is a valid event id", a)
	}
}

func TestIsBatch(t *testing.T) {
	for ct, want := range map[string]bool{
		BatchContentType:                     true,
		BatchContentType + "; charset=utf-8": true,
		ContentType:                          false,
		"":                                   false,
	} {
		if got := IsBatch(ct); got != want {
			t.Errorf("IsBatch(%q) = %v, want %v", ct, got, want)
		}
	}
}

// FuzzDecodeBatch checks that DecodeBatch never panics, that a whole-batch
// error leaves nothing, and that each element's result is exactly Decode's
// of that element. Seeds: testdata/fuzz/FuzzDecodeBatch.
func FuzzDecodeBatch(f *testing.F) {
	b, err := EncodeBatch(examples())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		evs, errs, raw, err := DecodeBatch(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || evs != nil || errs != nil || raw != nil {
				t.Fatalf("DecodeBatch(%q) = %v, %v, %v, %v", b, evs, errs, raw, err)
			}
			return
		}
		if len(evs) == 0 || len(evs) > MaxBatchEvents || len(errs) != len(evs) || len(raw) != len(evs) {
			t.Fatalf("DecodeBatch(%q): %d events, %d errors, %d raw", b, len(evs), len(errs), len(raw))
		}
		for i, e := range raw {
			if !bytes.Contains(b, e) {
				t.Fatalf("element %d %q is not part of the input", i, e)
			}
			ev, derr := Decode(e)
			if (derr == nil) != (errs[i] == nil) || !reflect.DeepEqual(ev, evs[i]) {
				t.Fatalf("batch[%d] = %+v, %v; Decode alone = %+v, %v", i, evs[i], errs[i], ev, derr)
			}
		}
	})
}
