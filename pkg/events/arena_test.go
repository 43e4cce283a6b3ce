package events

import "testing"

// An arena goes back to the pool with no member set, whether the decode
// stayed within it (only its used members are cleared) or outgrew it.
func TestPutArenaLeavesItClear(t *testing.T) {
	obj := []byte(`{"a":"1","b":{"c":"2","d":"3"},"e":[{"f":"4"}]}`)
	for _, size := range []int{64, 2} { // room to spare; too small, so object moves to a new array
		a := new([]member)
		*a = make([]member, 0, size)
		free := (*a)[:0]
		if _, err := object(obj, &free); err != nil {
			t.Fatal(err)
		}
		if size == 64 && cap(free) == size {
			t.Fatalf("object used none of the arena: the test shows nothing")
		}
		putArena(a, free)
		for i, m := range (*a)[:cap(*a)] {
			if m.key != nil || m.val != nil {
				t.Fatalf("size %d: member %d left set after putArena: %+v", size, i, m)
			}
		}
	}
}
