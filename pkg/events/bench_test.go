package events

import "testing"

func BenchmarkDecode(b *testing.B) {
	for _, typ := range []string{TypeReserved, TypeActual} {
		var ev Event
		for _, e := range examples() {
			if e.Type() == typ {
				ev = e
			}
		}
		data, err := Encode(ev)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(typ, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				if _, err := Decode(data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEncode encodes the largest example, a reserved event, as
// publishers do (validation included), and with encoding/json as the
// baseline.
func BenchmarkEncode(b *testing.B) {
	ev := examples()[0] // reserved, the largest
	for name, encode := range map[string]func() ([]byte, error){
		"hand-written":  func() ([]byte, error) { return Encode(ev) },
		"encoding-json": func() ([]byte, error) { _ = ev.Validate(); return ev.marshalSlow() },
	} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := encode(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
