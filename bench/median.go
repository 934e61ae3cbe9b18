package bench

import (
	"cmp"
	"slices"
)

// medianRun returns the run with the median value among runs (the lower
// middle one for an even count; failed runs sort after every other) and,
// when there is more than one run, the values of the runs that did not
// fail, ascending. runs must not be empty.
func medianRun[T any](runs []T, failed func(T) bool, value func(T) float64) (T, []float64) {
	rs := slices.Clone(runs)
	slices.SortStableFunc(rs, func(a, b T) int {
		if fa, fb := failed(a), failed(b); fa != fb {
			if fa {
				return 1
			}
			return -1
		}
		return cmp.Compare(value(a), value(b))
	})
	var values []float64
	if len(rs) > 1 {
		for _, r := range rs {
			if !failed(r) {
				values = append(values, value(r))
			}
		}
	}
	return rs[(len(rs)-1)/2], values
}
