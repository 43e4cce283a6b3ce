package stream

import (
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

func TestGroups(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sizes []int // events per message
		max   int
		want  [][]int
	}{
		{"none", nil, 10, nil},
		{"one run", []int{3, 3, 4}, 10, [][]int{{3, 3, 4}}},
		{"split at max", []int{3, 3, 4, 1}, 10, [][]int{{3, 3, 4}, {1}}},
		{"a large message alone", []int{2, 30, 2}, 10, [][]int{{2}, {30}, {2}}},
		{"large first", []int{30, 1}, 10, [][]int{{30}, {1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ds []*Delivery
			for _, n := range tc.sizes {
				ds = append(ds, &Delivery{Events: make([]events.Event, n)})
			}
			var got [][]int
			// Fetched just now: no run is late, so none is marked in progress.
			Groups(Fetched{At: time.Now()}, ds, tc.max, Config{AckWait: time.Hour}, func(g []*Delivery) {
				var sizes []int
				for _, d := range g {
					sizes = append(sizes, len(d.Events))
				}
				got = append(got, sizes)
			})
			if !slices.EqualFunc(got, tc.want, slices.Equal) {
				t.Errorf("Groups(%v, max %d) = %v, want %v", tc.sizes, tc.max, got, tc.want)
			}
		})
	}
}

// ids lays out messages of events named by their ids ("" for an event of
// no group) and lists a split's runs the same way.
func ids(msgs ...[]string) []*Delivery {
	var ds []*Delivery
	for _, m := range msgs {
		d := &Delivery{}
		for _, id := range m {
			d.Events = append(d.Events, events.Event{ID: id})
		}
		ds = append(ds, d)
	}
	return ds
}

func runIDs(runs [][]*Delivery) [][][]string {
	var out [][][]string
	for _, run := range runs {
		var r [][]string
		for _, d := range run {
			var m []string
			for _, ev := range d.Events {
				m = append(m, ev.ID)
			}
			r = append(r, m)
		}
		out = append(out, r)
	}
	return out
}

// msgs are messages of events named by their ids, byID their groups.
type msgs = [][]string

func byID(ev events.Event) (string, bool) { return ev.ID, ev.ID != "" }

func equalRuns(a, b [][][]string) bool {
	return slices.EqualFunc(a, b, func(a, b [][]string) bool { return slices.EqualFunc(a, b, slices.Equal) })
}

func TestRunsByKeepsGroupsTogether(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   msgs
		max  int
		want []msgs
	}{
		{
			// Runs would cut after [c d], parting c and d; cutting after
			// [a b] parts none, and so does the cut after the second [c d].
			"the cut that parts none", msgs{{"a", "b"}, {"c", "d"}, {"c", "d"}, {"e"}}, 4,
			[]msgs{{{"a", "b"}}, {{"c", "d"}, {"c", "d"}}, {{"e"}}},
		},
		{
			"the latest of equal cuts", msgs{{"a", "b"}, {"c", "d"}, {"e", "f"}}, 4,
			[]msgs{{{"a", "b"}, {"c", "d"}}, {{"e", "f"}}},
		},
		{
			// A cut before half of max is never taken, however few it parts.
			"at least half of max", msgs{{"a"}, {"b", "c", "d"}, {"b", "c", "d"}}, 6,
			[]msgs{{{"a"}, {"b", "c", "d"}}, {{"b", "c", "d"}}},
		},
		{
			"events of no group", msgs{{"", ""}, {"a", ""}, {"a", ""}}, 4,
			[]msgs{{{"", ""}}, {{"a", ""}, {"a", ""}}},
		},
		{
			"a large message alone", msgs{{"a"}, {"a", "b", "c", "d", "e"}, {"e"}}, 4,
			[]msgs{{{"a"}}, {{"a", "b", "c", "d", "e"}}, {{"e"}}},
		},
		{"what fits is one run", msgs{{"a", "b"}, {"b", "c"}}, 4, []msgs{{{"a", "b"}, {"b", "c"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs, held := RunsBy(ids(tc.in...), tc.max, byID, len(tc.in))
			got := runIDs(runs)
			want := runIDs(nil)
			for _, run := range tc.want {
				want = append(want, runIDs([][]*Delivery{ids(run...)})...)
			}
			if !equalRuns(got, want) {
				t.Errorf("RunsBy(%v, max %d) = %v, want %v", tc.in, tc.max, got, want)
			}
			if len(held) != 0 {
				t.Errorf("RunsBy(%v, hold none) held %d messages", tc.in, len(held))
			}
		})
	}
}

func TestRunsByHoldsWhatTheNextFetchMayEnd(t *testing.T) {
	for _, tc := range []struct {
		name       string
		in         msgs
		hold       int
		kept, held msgs
	}{
		// c's one event may meet its other next fetch; a's have met.
		{"a single at the end", msgs{{"a", "b"}, {"a"}, {"c"}}, 1, msgs{{"a", "b"}, {"a"}}, msgs{{"c"}}},
		// b's single before hold does not count: it came too early.
		{"nothing to wait for", msgs{{"a", "b"}, {"a"}}, 1, msgs{{"a", "b"}, {"a"}}, nil},
		// A cut after {"a", "c"} parts c, one after {"c", "d"} d's
		// single (one each: the later cut), none holds both singles.
		{"a group begun in the window", msgs{{"a"}, {"a", "c"}, {"c", "d"}, {"e"}}, 2, msgs{{"a"}, {"a", "c"}, {"c", "d"}}, msgs{{"e"}}},
		// Held from {"x"} on, x and y wait together for their others.
		{"singles wait together", msgs{{"a"}, {"a"}, {"x"}, {"y"}}, 2, msgs{{"a"}, {"a"}}, msgs{{"x"}, {"y"}}},
		// The first message is always kept.
		{"all within the window", msgs{{"a"}, {"b"}}, 0, msgs{{"a"}}, msgs{{"b"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs, held := RunsBy(ids(tc.in...), 100, byID, tc.hold)
			var kept []*Delivery
			for _, r := range runs {
				kept = append(kept, r...)
			}
			if got, want := runIDs([][]*Delivery{kept}), runIDs([][]*Delivery{ids(tc.kept...)}); !equalRuns(got, want) {
				t.Errorf("kept %v, want %v", got, want)
			}
			if got, want := runIDs([][]*Delivery{held}), runIDs([][]*Delivery{ids(tc.held...)}); !equalRuns(got, want) {
				t.Errorf("held %v, want %v", got, want)
			}
		})
	}
}

// progressMsg counts the InProgress marks of a message.
type progressMsg struct {
	jetstream.Msg
	marks *int
}

func (m progressMsg) InProgress() error { *m.marks++; return nil }

func TestPendingMarksWaitingRunsWhenLate(t *testing.T) {
	marks := make([]int, 4)
	var ds []*Delivery
	for i := range marks {
		ds = append(ds, &Delivery{Msg: progressMsg{marks: &marks[i]}, Events: make([]events.Event, 1)})
	}
	p := NewPending(Config{AckWait: time.Hour})
	// Fetched an hour ago: the first run taken marks every message
	// waiting, the held one too.
	p.Add(Fetched{At: time.Now().Add(-time.Hour)}, Runs(ds[:3], 1), ds[3:])
	for want, i := []int{1, 1, 1, 1}, 0; i < 3; i++ {
		if _, ok := p.Next(); !ok {
			t.Fatalf("run %d not pending", i)
		}
		// The later runs come within the quarter hour: no new marks.
		if !slices.Equal(marks, want) {
			t.Fatalf("after run %d: marks %v, want %v", i, marks, want)
		}
	}
	if _, ok := p.Next(); ok || p.Waiting() {
		t.Error("a run pending after all were taken")
	}
	if held, _ := p.TakeHeld(); len(held) != 1 || held[0] != ds[3] {
		t.Errorf("held %v, want the fourth message", held)
	}
	if held, _ := p.TakeHeld(); len(held) != 0 {
		t.Errorf("held %v after it was taken", held)
	}
	// A fresh fetch is not late: nothing is marked. Behind it, the held
	// messages of an older fetch make the oldest time the one to mark by.
	p.Add(Fetched{At: time.Now()}, Runs(ds[:2], 1), nil)
	if _, ok := p.Next(); !ok || marks[0] != 1 {
		t.Errorf("fresh run: ok %v, marks %v, want the first still 1", ok, marks)
	}
	p.Add(Fetched{At: time.Now().Add(-time.Hour)}, Runs(ds[2:3], 1), nil)
	if _, ok := p.Next(); !ok || !slices.Equal(marks, []int{1, 2, 2, 1}) {
		t.Errorf("behind an older fetch: ok %v, marks %v, want the two waiting marked again", ok, marks)
	}
}

// stalledConsumer's pulls deliver what their channel gets and never end:
// a pull the server ended without its status.
type stalledConsumer struct {
	jetstream.Consumer
	msgs chan jetstream.Msg
}

func (c stalledConsumer) Fetch(int, ...jetstream.FetchOpt) (jetstream.MessageBatch, error) {
	return stalledBatch{c.msgs}, nil
}

type stalledBatch struct{ msgs chan jetstream.Msg }

func (b stalledBatch) Messages() <-chan jetstream.Msg { return b.msgs }
func (stalledBatch) Error() error                     { return nil }

// nakMsg counts its naks.
type nakMsg struct {
	jetstream.Msg
	naks *atomic.Int32
}

func (m nakMsg) Nak() error { m.naks.Add(1); return nil }

func TestFetchStopsPastItsWait(t *testing.T) {
	var naks atomic.Int32
	msgs := make(chan jetstream.Msg, 4)
	msgs <- nakMsg{naks: &naks}
	done := make(chan Fetched, 1)
	go func() {
		f, err := Fetch(stalledConsumer{msgs: msgs}, 10, 10*time.Millisecond)
		if err != nil {
			t.Error(err)
		}
		done <- f
	}()
	select {
	case f := <-done:
		if len(f.Msgs) != 1 {
			t.Errorf("Fetch took %d messages, want the one that had arrived", len(f.Msgs))
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Fetch still waiting 5 s past its wait of 10 ms")
	}
	// A message the stalled pull delivers later is nak'ed, to come again.
	msgs <- nakMsg{naks: &naks}
	close(msgs)
	for deadline := time.Now().Add(5 * time.Second); naks.Load() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d naks 5 s after a late message, want 1", naks.Load())
		}
	}
}
