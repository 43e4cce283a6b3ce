package ledger

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
)

// Partitioned are the ledger's tables partitioned by day (migration 009):
// each partition covers whole UTC days [from, to) of the day its rows were
// first written. They are in the order a batch locks them (usage_events,
// then reservation_keys, then reservations), which the partition task
// keeps so that it cannot deadlock with one.
var Partitioned = []string{"usage_events", "reservations"}

// DefaultPartitionDays is the width of a partition created ahead
// (QF_LEDGER_PARTITION_DAYS).
const DefaultPartitionDays = 1

// AheadDays is how many days after today the partitions reach once
// EnsurePartitions ran: the hourly task may fail for that long before a
// write finds no partition.
const AheadDays = 3

// partitionLock is the advisory lock id under which instances create and
// drop partitions, one at a time ("qf-part" in ASCII).
const partitionLock = 0x71662d70617274

// Partition is one partition of a Partitioned table. From is zero for the
// first partition, which holds every day before To.
type Partition struct {
	Table, Name string
	From, To    time.Time
}

const selectPartitions = `
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = $1::regclass`

// boundRE reads a range partition's bound as pg_get_expr prints it.
var boundRE = regexp.MustCompile(`^FOR VALUES FROM \((MINVALUE|'(\d{4}-\d{2}-\d{2})')\) TO \('(\d{4}-\d{2}-\d{2})'\)$`)

// Partitions lists the partitions of table, in no order.
func (s *Store) Partitions(ctx context.Context, table string) ([]Partition, error) {
	return partitions(ctx, s.pool, table)
}

type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func partitions(ctx context.Context, q querier, table string) ([]Partition, error) {
	rows, err := q.Query(ctx, selectPartitions, table)
	if err != nil {
		return nil, fmt.Errorf("list partitions of %s: %w", table, err)
	}
	var out []Partition
	var name, bound string
	_, err = pgx.ForEachRow(rows, []any{&name, &bound}, func() error {
		m := boundRE.FindStringSubmatch(bound)
		if m == nil {
			return fmt.Errorf("partition %s: unexpected bound %q", name, bound)
		}
		p := Partition{Table: table, Name: name}
		if m[2] != "" {
			p.From, _ = time.Parse(time.DateOnly, m[2]) // the regexp checked its shape
		}
		p.To, _ = time.Parse(time.DateOnly, m[3])
		out = append(out, p)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list partitions of %s: %w", table, err)
	}
	return out, nil
}

// EnsurePartitions creates the partitions of every Partitioned table from
// the end of its last one (or the start of today's width-day period) until
// they cover AheadDays after now's day, each width days wide and ending on
// a multiple of width days since 1970-01-01, so that instances agree. It
// runs under an advisory lock; running it again creates nothing. It returns
// the partitions it created.
//
// Each is created as a table of its own, then attached: ATTACH PARTITION
// takes SHARE UPDATE EXCLUSIVE on the parent, which writes do not wait
// for, where CREATE TABLE ... PARTITION OF takes ACCESS EXCLUSIVE.
func (s *Store) EnsurePartitions(ctx context.Context, now time.Time, width int) ([]Partition, error) {
	if width < 1 {
		return nil, fmt.Errorf("partition width %d days: want at least 1", width)
	}
	var created []Partition
	err := s.maintain(ctx, func(tx pgx.Tx) error {
		until := Day(now).AddDate(0, 0, AheadDays+1)
		for _, table := range Partitioned {
			parts, err := partitions(ctx, tx, table)
			if err != nil {
				return err
			}
			from := alignDown(Day(now), width)
			if len(parts) > 0 {
				from = parts[0].To
				for _, p := range parts[1:] {
					if p.To.After(from) {
						from = p.To
					}
				}
			}
			for from.Before(until) {
				p := Partition{Table: table, Name: table + "_" + from.Format("20060102"), From: from, To: alignDown(from, width).AddDate(0, 0, width)}
				name, parent := pgx.Identifier{p.Name}.Sanitize(), pgx.Identifier{table}.Sanitize()
				for _, q := range []string{
					fmt.Sprintf(`CREATE TABLE %s (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`, name, parent),
					fmt.Sprintf(`ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s')`,
						parent, name, p.From.Format(time.DateOnly), p.To.Format(time.DateOnly)),
				} {
					if _, err := tx.Exec(ctx, q); err != nil {
						return fmt.Errorf("create partition %s: %w", p.Name, err)
					}
				}
				created = append(created, p)
				from = p.To
			}
		}
		return nil
	})
	return created, err
}

// alignDown is the start of the width-day period holding day.
func alignDown(day time.Time, width int) time.Time {
	days := int(day.Unix() / 86400)
	return time.Unix(int64(days-days%width)*86400, 0).UTC()
}

// ErrRetentionTooShort is returned by DropPartitions when the retention is
// shorter than the floor it was given.
var ErrRetentionTooShort = errors.New("the retention is shorter than its floor")

// foldSpent and foldCredited add what a partition about to be dropped
// holds of every prepaid balance to balance_carry (see Balances): what its
// reservations spent by their plan, its top-ups under the empty plan.
const (
	foldSpent = `
INSERT INTO balance_carry AS b (tenant, user_id, plan, spent)
SELECT tenant, user_id, plan, sum(` + heldTokens + `)::bigint FROM %s
GROUP BY tenant, user_id, plan HAVING sum(` + heldTokens + `) <> 0
ON CONFLICT (tenant, user_id, plan) DO UPDATE SET spent = b.spent + excluded.spent`
	foldCredited = `
INSERT INTO balance_carry AS b (tenant, user_id, credited)
SELECT tenant, user_id, sum(tokens)::bigint FROM %s WHERE type = 'quotaflow.balance.topup'
GROUP BY tenant, user_id
ON CONFLICT (tenant, user_id, plan) DO UPDATE SET credited = b.credited + excluded.credited`
	// The dedup rows of a dropped partition's days: its requests' keys,
	// its events' ids but top-ups'.
	pruneKeys = `DELETE FROM reservation_keys WHERE day >= $1 AND day < $2`
	pruneIDs  = `DELETE FROM event_ids WHERE day >= $1 AND day < $2 AND NOT topup`
)

// DropPartitions drops every partition of the Partitioned tables whose
// days all lie more than retention before now's day, in one transaction
// under the advisory lock: their prepaid balance effects are folded into
// balance_carry first and their dedup rows pruned (a later event of one of
// their requests makes a new row). It refuses (ErrRetentionTooShort) a
// retention shorter than floor. It returns the dropped partitions.
//
// Each partition is locked IN SHARE MODE before its fold, so that a write
// to it committing before the DROP cannot be left out of the fold. The
// DROPs, which lock their parents ACCESS EXCLUSIVE until the commit, come
// last, after every fold, so that writes of today's rows wait for them only.
func (s *Store) DropPartitions(ctx context.Context, now time.Time, retention, floor time.Duration) ([]Partition, error) {
	if retention < floor {
		return nil, fmt.Errorf("%w: %v < %v", ErrRetentionTooShort, retention, floor)
	}
	cutoff := Day(now.Add(-retention))
	var dropped []Partition
	err := s.maintain(ctx, func(tx pgx.Tx) error {
		var old []Partition
		for _, table := range Partitioned {
			parts, err := partitions(ctx, tx, table)
			if err != nil {
				return err
			}
			for _, p := range parts {
				if p.To.After(cutoff) {
					continue
				}
				name := pgx.Identifier{p.Name}.Sanitize()
				fold, prune := foldSpent, pruneKeys
				if table == "usage_events" {
					fold, prune = foldCredited, pruneIDs
				}
				if _, err := tx.Exec(ctx, "LOCK TABLE "+name+" IN SHARE MODE"); err != nil {
					return fmt.Errorf("lock partition %s: %w", p.Name, err)
				}
				if _, err := tx.Exec(ctx, fmt.Sprintf(fold, name)); err != nil {
					return fmt.Errorf("fold partition %s into balance_carry: %w", p.Name, err)
				}
				if _, err := tx.Exec(ctx, prune, p.From, p.To); err != nil {
					return fmt.Errorf("prune the keys of partition %s: %w", p.Name, err)
				}
				old = append(old, p)
			}
		}
		for _, p := range old {
			if _, err := tx.Exec(ctx, "DROP TABLE "+pgx.Identifier{p.Name}.Sanitize()); err != nil {
				return fmt.Errorf("drop partition %s: %w", p.Name, err)
			}
		}
		dropped = old
		return nil
	})
	if err != nil {
		return nil, err
	}
	return dropped, nil
}

// maintain runs f in a transaction holding the partition lock. Its DDL
// gives up after lock_timeout rather than queue every ledger write behind
// a long query; the next run tries again.
func (s *Store) maintain(ctx context.Context, f func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '2s'"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", partitionLock); err != nil {
			return fmt.Errorf("partition lock: %w", err)
		}
		return f(tx)
	})
}
