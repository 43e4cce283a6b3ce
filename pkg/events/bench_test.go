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

func BenchmarkEncode(b *testing.B) {
	ev := examples()[0] // reserved, the largest
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Encode(ev); err != nil {
			b.Fatal(err)
		}
	}
}
