package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Sample is one series of a service's /metrics.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// Scrape reads every sample a service's /metrics serves at opsURL (text
// format, parsed by hand: the services' metrics are plain counters, gauges
// and histograms, and pulling in a parser module for them is not worth a
// go.mod change). Comment lines and lines it cannot parse are skipped.
func Scrape(ctx context.Context, opsURL string) ([]Sample, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s/metrics: %s", opsURL, resp.Status)
	}
	var out []Sample
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for sc.Scan() {
		if s, ok := parseSample(sc.Text()); ok {
			out = append(out, s)
		}
	}
	return out, sc.Err()
}

// parseSample parses `name{k="v",...} value` or `name value`.
func parseSample(line string) (Sample, bool) {
	if line == "" || line[0] == '#' {
		return Sample{}, false
	}
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return Sample{}, false
	}
	s := Sample{Name: line[:i], Labels: map[string]string{}}
	rest := line[i:]
	if rest[0] == '{' {
		end, ok := parseLabels(rest[1:], s.Labels)
		if !ok {
			return Sample{}, false
		}
		rest = rest[1+end:]
	}
	fields := strings.Fields(rest) // the value, then an optional timestamp
	if len(fields) == 0 {
		return Sample{}, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return Sample{}, false
	}
	s.Value = v
	return s, true
}

// parseLabels reads k="v" pairs up to the closing brace into m and returns
// the length read, the brace included. Values are unescaped (\\, \", \n).
func parseLabels(s string, m map[string]string) (int, bool) {
	i := 0
	for {
		for i < len(s) && (s[i] == ',' || s[i] == ' ') {
			i++
		}
		if i < len(s) && s[i] == '}' {
			return i + 1, true
		}
		eq := strings.IndexByte(s[i:], '=')
		if eq < 0 || i+eq+1 >= len(s) || s[i+eq+1] != '"' {
			return 0, false
		}
		key := s[i : i+eq]
		i += eq + 2
		var v strings.Builder
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				if s[i] == 'n' {
					v.WriteByte('\n')
					continue
				}
			}
			v.WriteByte(s[i])
		}
		if i >= len(s) {
			return 0, false
		}
		m[key] = v.String()
		i++ // the closing quote
	}
}

// Sum adds up the samples of metric name whose labels include every pair
// of labels ("key", "value", ...): 0 when there is none.
func Sum(samples []Sample, name string, labels ...string) float64 {
	var n float64
next:
	for _, s := range samples {
		if s.Name != name {
			continue
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if s.Labels[labels[i]] != labels[i+1] {
				continue next
			}
		}
		n += s.Value
	}
	return n
}

// Metric is Sum over a fresh Scrape of s's /metrics.
func (s *Service) Metric(ctx context.Context, name string, labels ...string) (float64, error) {
	samples, err := Scrape(ctx, s.Ops)
	return Sum(samples, name, labels...), err
}
