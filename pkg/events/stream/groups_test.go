package stream

import (
	"slices"
	"testing"
	"time"

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
