package wire

import (
	"context"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestDecodeCountShapes: a reply of exactly the batch's groups is
// decoded group by group (a lost group's -1 alone); one value missing or
// left over, a bad status or an empty reply fails every group.
func TestDecodeCountShapes(t *testing.T) {
	b := &CountBatch{groups: []int{2, 1, 1}}
	for _, tc := range []struct {
		name  string
		reply []any
		want  []string // per group: "ok", "noepoch", "err"
	}{
		{"exact", []any{int64(7), int64(1), int64(3), int64(4), int64(0), int64(9), int64(1), int64(2)}, []string{"ok", "ok", "ok"}},
		{"lost first and last", []any{int64(7), int64(-1), int64(0), int64(9), int64(-1)}, []string{"noepoch", "ok", "noepoch"}},
		{"lost last with leftovers", []any{int64(7), int64(-1), int64(0), int64(9), int64(-1), int64(5)}, []string{"err", "err", "err"}},
		{"one short", []any{int64(7), int64(1), int64(3), int64(4), int64(0), int64(9), int64(1)}, []string{"err", "err", "err"}},
		{"bad status", []any{int64(7), int64(1), int64(3), int64(4), int64(2), int64(9), int64(1), int64(2)}, []string{"err", "err", "err"}},
		{"empty", []any{}, []string{"err", "err", "err"}},
	} {
		cmd := redis.NewCmd(context.Background())
		cmd.SetVal(tc.reply)
		var got []string
		DecodeCount(cmd, b, func(i int, v CountReply, err error) {
			switch {
			case errors.Is(err, ErrNoEpoch):
				got = append(got, "noepoch")
			case err != nil:
				got = append(got, "err")
			default:
				got = append(got, "ok")
			}
		})
		if len(got) != len(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
				break
			}
		}
	}
}
