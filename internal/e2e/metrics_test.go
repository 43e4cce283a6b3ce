package e2e

import (
	"maps"
	"testing"
)

func TestParseSample(t *testing.T) {
	for _, tc := range []struct {
		line string
		want Sample
		ok   bool
	}{
		{`quotaflow_x_total 3`, Sample{Name: "quotaflow_x_total", Labels: map[string]string{}, Value: 3}, true},
		{`quotaflow_x_total{result="ok",type="a,b"} 1.5e+06`,
			Sample{Name: "quotaflow_x_total", Labels: map[string]string{"result": "ok", "type": "a,b"}, Value: 1.5e6}, true},
		{`x{endpoint="/v1/\"q\"\\z"} 2 1700000000`, Sample{Name: "x", Labels: map[string]string{"endpoint": `/v1/"q"\z`}, Value: 2}, true},
		{`x{} 0`, Sample{Name: "x", Labels: map[string]string{}}, true},
		{`# HELP x what`, Sample{}, false},
		{`x{a="1" 2`, Sample{}, false},
		{`x{a=1} 2`, Sample{}, false},
		{`x NaNa`, Sample{}, false},
		{``, Sample{}, false},
	} {
		got, ok := parseSample(tc.line)
		if ok != tc.ok || got.Name != tc.want.Name || got.Value != tc.want.Value || !maps.Equal(got.Labels, tc.want.Labels) {
			t.Errorf("parseSample(%q) = %+v, %v; want %+v, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

func TestSum(t *testing.T) {
	ss := []Sample{
		{Name: "e", Labels: map[string]string{"type": "a", "result": "ok"}, Value: 2},
		{Name: "e", Labels: map[string]string{"type": "b", "result": "ok"}, Value: 3},
		{Name: "e", Labels: map[string]string{"type": "b", "result": "retry"}, Value: 5},
		{Name: "f", Labels: map[string]string{"result": "ok"}, Value: 7},
	}
	for _, tc := range []struct {
		labels []string
		want   float64
	}{{nil, 10}, {[]string{"result", "ok"}, 5}, {[]string{"type", "b", "result", "retry"}, 5}, {[]string{"type", "c"}, 0}} {
		if got := Sum(ss, "e", tc.labels...); got != tc.want {
			t.Errorf("Sum(e, %q) = %v, want %v", tc.labels, got, tc.want)
		}
	}
}
