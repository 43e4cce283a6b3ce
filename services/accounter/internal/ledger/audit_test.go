package ledger

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestCheckAuditAgreesWithPostgres stores each event and reads it back as
// the audit does: CheckAudit refuses exactly those Postgres's jsonb cannot
// parse (and never lets one through that it cannot).
func TestCheckAuditAgreesWithPostgres(t *testing.T) {
	pool := testPool(t)
	ctx := context.Background()
	cases := []struct {
		json   string
		refuse bool
	}{
		{`{"a":"plain","b":[1,-2.5e3,true,null]}`, false},
		{`{"a":"x\u0000y"}`, true},
		{`{"a\u0000":1}`, true},    // a key
		{`{"a":"\\u0000"}`, false}, // an escaped backslash, then text
		{`{"a":"\\\u0000"}`, true},
		{`{"a":"\u0001\n\"\u00e9"}`, false},
		{`{"a":"\ud83d\ude00"}`, false}, // a pair
		{`{"a":"\uD83D\uDE00"}`, false},
		{`{"a":"\ud800"}`, true},
		{`{"a":"\ud800x"}`, true},
		{`{"a":"\ud800\u0041"}`, true},
		{`{"a":"\ud800\ud800"}`, true},
		{`{"a":"\udc00"}`, true},
		{`{"a":"x\ud800"}`, true},
		{`{"a":1e131071}`, false},
		{`{"a":1e131072}`, true},
		{`{"a":1e-16383}`, false},
		{`{"a":1e-16384}`, true},
		{`{"a":-1E+131072}`, true},
		{`{"a":0.` + strings.Repeat("1", 16383) + `}`, false},
		{`{"a":0.` + strings.Repeat("1", 16383) + `e-1}`, true},
		{`{"a":1e99999999999999999999}`, true},
		{`{"a":"1e131072"}`, false}, // a string
	}
	for _, c := range cases {
		err := CheckAudit([]byte(c.json))
		if (err != nil) != c.refuse {
			t.Errorf("CheckAudit(%.60s) = %v, want refused %v", c.json, err, c.refuse)
		}
		if err != nil && !errors.Is(err, ErrUnreadable) {
			t.Errorf("CheckAudit(%.60s) = %v, not ErrUnreadable", c.json, err)
		}
		var ok bool
		perr := pool.QueryRow(ctx, `SELECT convert_from($1::bytea, 'UTF8')::jsonb IS NOT NULL`, []byte(c.json)).Scan(&ok)
		if (perr != nil) != c.refuse {
			t.Errorf("Postgres reads %.60s: %v, want refused %v (the case is wrong)", c.json, perr, c.refuse)
		}
	}
}
