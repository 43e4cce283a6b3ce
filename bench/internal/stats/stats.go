// Package stats holds the arithmetic the benchmark commands share over
// their rounds.
package stats

import "slices"

// Median is the median of v (the mean of the middle two for an even
// count), 0 for none.
func Median(v []float64) float64 {
	s := slices.Sorted(slices.Values(v))
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
