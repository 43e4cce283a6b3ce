package alertlog

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"quotaflow/internal/server"
)

// DefaultTimeout bounds one request of a Client (QF_ALERTER_TIMEOUT).
const DefaultTimeout = 5 * time.Second

// maxBody bounds an answer read from the alerter: a full page of MaxLimit
// alerts is under 150 kB.
const maxBody = 1 << 20

// The errors of Client.Recent, for the accounter to answer its caller.
var (
	// ErrUnreachable: the alerter did not answer in time, or not at all (503).
	ErrUnreachable = errors.New("the alerter cannot be reached")
	// ErrBadAnswer: the alerter answered something other than a List (502).
	ErrBadAnswer = errors.New("the alerter answered no alerts")
)

// Client reads a tenant's recent alerts from the alerter's GET /v1/alerts,
// presenting its caller's own token so that the alerter decides what it
// may read. It follows no redirect and goes through no proxy
// (HTTP_PROXY): the token would go with them. It is safe for concurrent
// use.
type Client struct {
	base string // the alerter's URL, without a trailing slash
	hc   *http.Client
}

// NewClient returns a client of the alerter at base (http or https, no
// credentials, query or fragment: CheckURL), each request bounded by
// timeout.
func NewClient(base string, timeout time.Duration) (*Client, error) {
	if err := CheckURL(base); err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil
	return &Client{base: strings.TrimSuffix(base, "/"), hc: &http.Client{
		Transport:     tr,
		Timeout:       timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}, nil
}

// CheckURL says what is wrong with base as the alerter's URL, or nil.
func CheckURL(base string) error {
	u, err := url.Parse(base)
	switch {
	case err != nil:
		return errors.New("not a URL")
	case u.Scheme != "http" && u.Scheme != "https":
		return errors.New("want an http or https URL")
	case u.Host == "":
		return errors.New("want a host")
	case u.User != nil:
		return errors.New("want no credentials in the URL (the caller's own token is presented)")
	case u.RawQuery != "" || u.Fragment != "":
		return errors.New("want no query or fragment")
	}
	return nil
}

// Recent returns tenant's alerts as the alerter answers a request
// authorized by authorization (an Authorization header's value; empty:
// none): limit of them after the first offset, newest first. An error
// wraps ErrUnreachable or ErrBadAnswer, and says why (the alerter's own
// problem detail for a refusal), without the token.
func (c *Client) Recent(ctx context.Context, authorization, tenant string, limit, offset int) ([]Alert, error) {
	q := url.Values{"tenant": {tenant}, "limit": {strconv.Itoa(limit)}, "offset": {strconv.Itoa(offset)}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/v1/alerts?"+q.Encode(), nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its URL repeats the tenant; the cause is enough
		}
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody+1))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	if len(body) > maxBody {
		return nil, fmt.Errorf("%w: over %d bytes", ErrBadAnswer, maxBody)
	}
	if resp.StatusCode != http.StatusOK {
		var p server.ProblemBody
		if json.Unmarshal(body, &p) != nil || p.Detail == "" {
			return nil, fmt.Errorf("%w: %s", ErrBadAnswer, resp.Status)
		}
		return nil, fmt.Errorf("%w: %s: %.200s", ErrBadAnswer, resp.Status, p.Detail)
	}
	var l List
	if err := json.Unmarshal(body, &l); err != nil || l.Alerts == nil {
		return nil, fmt.Errorf("%w: %s", ErrBadAnswer, "not a JSON list of alerts")
	}
	return l.Alerts, nil
}
