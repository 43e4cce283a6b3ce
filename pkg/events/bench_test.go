package events

import (
	"encoding/json"
	"testing"
)

// BenchmarkDecode decodes a reserved and an actual event, whole and as
// the accounter does (Decoder.NoSnapshots).
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
		for name, dec := range map[string]Decoder{"": {}, "/no-snapshots": {NoSnapshots: true}} {
			b.Run(typ+name, func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(data)))
				for b.Loop() {
					if _, err := dec.Decode(data); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkEncode encodes a reserved event (the largest example, published
// per admit) and an actual one (published per report of POST /v1/usage) as
// publishers do (validation included), and with encoding/json as the
// baseline.
func BenchmarkEncode(b *testing.B) {
	for _, typ := range []string{TypeReserved, TypeActual} {
		var ev Event
		for _, e := range examples() {
			if e.Type() == typ {
				ev = e
				break
			}
		}
		for name, encode := range map[string]func() ([]byte, error){
			"hand-written":  func() ([]byte, error) { return Encode(ev) },
			"encoding-json": func() ([]byte, error) { _ = ev.Validate(); return ev.marshalSlow() },
		} {
			b.Run(typ+"/"+name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if _, err := encode(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkBatch encodes and decodes 100 reserved events one by one and as
// one batch, per event (ns/event).
func BenchmarkBatch(b *testing.B) {
	ev := examples()[0] // reserved, the largest
	evs := make([]Event, 100)
	for i := range evs {
		evs[i] = ev
		evs[i].ID = HashID("bench", string(rune('a'+i%26)), string(rune('a'+i/26)))
	}
	singles := make([][]byte, len(evs))
	for i := range evs {
		singles[i], _ = Encode(evs[i])
	}
	batch, err := EncodeBatch(evs)
	if err != nil {
		b.Fatal(err)
	}
	per := func(b *testing.B) {
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/event")
	}
	b.Run("encode/single", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for _, ev := range evs {
				if _, err := Encode(ev); err != nil {
					b.Fatal(err)
				}
			}
		}
		per(b)
	})
	b.Run("encode/batch", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := EncodeBatch(evs); err != nil {
				b.Fatal(err)
			}
		}
		per(b)
	})
	b.Run("decode/single", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for _, s := range singles {
				if _, err := Decode(s); err != nil {
					b.Fatal(err)
				}
			}
		}
		per(b)
	})
	b.Run("decode/batch", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, _, _, err := DecodeBatch(batch); err != nil {
				b.Fatal(err)
			}
		}
		per(b)
	})
}

// BenchmarkValidJSON checks a batch of 100 reserved events with validate
// and with json.Valid, which it replaces.
func BenchmarkValidJSON(b *testing.B) {
	evs := make([]Event, 100)
	for i := range evs {
		evs[i] = examples()[0]
		evs[i].ID = HashID("bench", string(rune('a'+i%26)), string(rune('a'+i/26)))
	}
	batch, err := EncodeBatch(evs)
	if err != nil {
		b.Fatal(err)
	}
	for name, valid := range map[string]func([]byte) bool{"validate": func(b []byte) bool { return validate(b, nil) }, "json.Valid": json.Valid} {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(batch)))
			for b.Loop() {
				if !valid(batch) {
					b.Fatal("invalid")
				}
			}
		})
	}
}
