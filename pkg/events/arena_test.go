package events

import "testing"

// A scratch goes back to the pool with no member set, whether the decode
// stayed within its arena (only its used members are cleared) or outgrew
// it.
func TestPutScratchLeavesItClear(t *testing.T) {
	obj := []byte(`{"a":"1","b":{"c":"2","d":"3"},"e":[{"f":"4"}]}`)
	for _, size := range []int{64, 2} { // room to spare; too small, so object moves to a new array
		s := &scratch{arena: make([]member, 0, size)}
		s.free = s.arena[:0]
		if _, err := object(obj, nil, &s.free); err != nil {
			t.Fatal(err)
		}
		if size == 64 && cap(s.free) == size {
			t.Fatalf("object used none of the arena: the test shows nothing")
		}
		putScratch(s)
		for i, m := range s.arena[:cap(s.arena)] {
			if m.key != nil || m.val != nil {
				t.Fatalf("size %d: member %d left set after putScratch: %+v", size, i, m)
			}
		}
		if s.free != nil || s.data.m != nil || s.check.problems != nil {
			t.Fatalf("size %d: putScratch left the decode's state: %+v", size, s)
		}
	}
}
