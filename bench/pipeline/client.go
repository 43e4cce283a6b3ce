package main

import (
	"math/rand/v2"
	"strconv"
	"time"

	"quotaflow/bench/internal/load"
	"quotaflow/pkg/events"
)

const (
	tenant   = "bench"
	endpoint = "/x" // plans.Five's endpoint limit applies to it
	// estimate is every admit's estimated tokens; the actual cost drawn
	// for a request is never equal to it, so every report makes the
	// accounter correct the windows.
	estimate = 100
	// usageTries bounds the resends of a report that got a 503 (JetStream
	// did not store it; its event id dedups a resend of one it did).
	usageTries = 50
)

// tally is what one connection's requests did; Run's connections each
// keep their own, summed afterwards.
type tally struct {
	admitted  int64         // admits answered 200: a reservation each
	refused   map[int]int64 // admits answered otherwise, by status
	reported  int64         // reports answered 202: one actual event stored each
	tokens    int64         // the actual tokens of those reports
	resent    int64         // reports sent again after a 503
	rejected  map[int]int64 // reports given up: by status (503 after usageTries)
	lostAdmit int64         // admits whose answer never came (the connection failed)
	// admitWait and reportWait sum the answer times of the admits and
	// of the reports (resent ones each count), admitLat and reportLat
	// count them, for their numbers and tails: in a closed loop the rate
	// is the connections over the sum of a request's two answer times.
	admitWait, reportWait time.Duration
	admitLat, reportLat   load.Histogram
}

func (t *tally) add(o *tally) {
	t.admitted += o.admitted
	t.reported += o.reported
	t.tokens += o.tokens
	t.resent += o.resent
	t.lostAdmit += o.lostAdmit
	t.admitWait += o.admitWait
	t.reportWait += o.reportWait
	t.admitLat.Merge(&o.admitLat)
	t.reportLat.Merge(&o.reportLat)
	for k, v := range o.refused {
		t.refused[k] += v
	}
	for k, v := range o.rejected {
		t.rejected[k] += v
	}
}

func newTally() *tally { return &tally{refused: map[int]int64{}, rejected: map[int]int64{}} }

// pipelineClient is one connection of a gateway and an LLM service in
// one: it admits a request for a random user and, once admitted, reports
// that request's actual usage in a POST /v1/usage of its own carrying one
// event, then admits the next. It is a load.Sequencer: a run that ends
// between an admit and its report still sends the report, so that no
// reservation is left open by the load's end.
type pipelineClient struct {
	admit, usage load.Post
	users        int
	prefix       string // the request ids' prefix: round and connection
	rnd          *rand.Rand
	t            *tally

	n       int    // requests admitted so far
	user    []byte // the current request's user
	id      []byte // the current request's id
	actual  int64  // the current request's actual tokens
	pending bool   // the current request is admitted and not yet reported
	tries   int    // reports of the current request sent
	body    []byte // scratch
}

func newClient(host, prefix string, users int, seed uint64, t *tally) *pipelineClient {
	return &pipelineClient{
		admit: load.NewPost(host, "/v1/admit"), usage: load.NewPost(host, "/v1/usage"),
		users: users, prefix: prefix, rnd: rand.New(rand.NewPCG(seed, 13)), t: t,
	}
}

// InSequence reports whether the request Next writes now is a report
// that an admit answered before it is waiting for.
func (c *pipelineClient) InSequence() bool { return c.pending }

func (c *pipelineClient) Next(buf []byte) []byte {
	b := c.body[:0]
	if c.pending {
		c.tries++
		b = append(b, `[{"specversion":"1.0","source":"bench-pipeline","type":"`+events.TypeActual+`","time":"`...)
		b = time.Now().UTC().AppendFormat(b, time.RFC3339Nano)
		b = append(b, `","datacontenttype":"application/json","data":{"request_id":"`...)
		b = append(b, c.id...)
		b = append(b, `","tenant":"`+tenant+`","user":"`...)
		b = append(b, c.user...)
		b = append(b, `","endpoint":"`+endpoint+`","input_tokens":`...)
		in := c.actual * 2 / 5
		b = strconv.AppendInt(b, in, 10)
		b = append(b, `,"output_tokens":`...)
		b = strconv.AppendInt(b, c.actual-in, 10)
		b = append(b, "}}]"...)
		c.body = b
		return c.usage.Append(buf, b)
	}
	c.n++
	c.id = strconv.AppendInt(append(c.id[:0], c.prefix...), int64(c.n), 10)
	c.user = strconv.AppendInt(append(c.user[:0], "u-"...), int64(c.rnd.IntN(c.users)), 10)
	b = append(b, `{"request_id":"`...)
	b = append(b, c.id...)
	b = append(b, `","tenant":"`+tenant+`","user":"`...)
	b = append(b, c.user...)
	b = append(b, `","endpoint":"`+endpoint+`","estimated_tokens":`+strconv.Itoa(estimate)+`}`...)
	c.body = b
	// An admit whose answer never comes leaves a request unknown: count it
	// now, and take it back when its answer is seen.
	c.t.lostAdmit++
	return c.admit.Append(buf, b)
}

func (c *pipelineClient) Response(status int, _ []byte, latency time.Duration) {
	if !c.pending {
		c.t.admitWait += latency
		c.t.admitLat.Record(latency)
		c.t.lostAdmit--
		if status != 200 {
			c.t.refused[status]++
			return
		}
		c.t.admitted++
		c.pending, c.tries = true, 0
		// 0.5 to 1.2 times the estimate, never the estimate itself.
		c.actual = int64(estimate/2 + c.rnd.IntN(estimate*7/10+1))
		if c.actual == estimate {
			c.actual++
		}
		return
	}
	c.t.reportWait += latency
	c.t.reportLat.Record(latency)
	switch {
	case status == 202:
		c.t.reported++
		c.t.tokens += c.actual
	case status == 503 && c.tries < usageTries:
		c.t.resent++
		return // sent again by the next Next
	default:
		c.t.rejected[status]++
	}
	c.pending = false
}
