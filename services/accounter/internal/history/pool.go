package history

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The console's reads of the ledger run on a pool of their own
// (PoolOptions), never on the one the consumer writes the ledger through:
// however many reads a token keeps in flight, they wait for each other's
// connections, and a writer never waits for theirs.
const (
	// DefaultConns is QF_CONSOLE_DB_CONNS's default: four reads at once
	// keep a few viewers' pages moving (a page makes one read of the
	// ledger) while the console adds at most four busy backends to the
	// ledger's database, next to the consumer's QF_WORKERS+5.
	DefaultConns = 4
	// DefaultQueryTimeout is QF_CONSOLE_QUERY_TIMEOUT's default: about a
	// hundred times the 70 ms the widest history (744 days by day) of a
	// tenant with 200,000 requests takes, and well inside the console
	// server's 30 s write timeout, so the 503 still reaches the client.
	DefaultQueryTimeout = 10 * time.Second
	// AppName is the application_name of the pool's sessions, as
	// pg_stat_activity shows them.
	AppName = "quotaflow-accounter-console"
)

// ErrTimeout is a read of the ledger that did not finish within the
// query timeout, its wait for a connection included (503).
var ErrTimeout = errors.New("reading the ledger took longer than the console allows (QF_CONSOLE_QUERY_TIMEOUT)")

// PoolOptions bound the console's own pool of the ledger's database.
type PoolOptions struct {
	// Conns is the most connections the pool opens: reads past it wait
	// for one.
	Conns int
	// QueryTimeout bounds a read: the Reader gives up on one, its wait
	// for a connection included, past it (ErrTimeout), and Postgres
	// cancels a statement running longer (statement_timeout, set on every
	// connection), even when the Reader's cancel never reaches it.
	QueryTimeout time.Duration
}

// Configure sets pc, for pgdb.Open or pgdb.Connect: at most o.Conns
// connections, each read-only, named AppName, with o.QueryTimeout as its
// statement_timeout. (A read whose context ends is cancelled on the server
// too: pgx sends a cancel request as it drops the connection.)
func (o PoolOptions) Configure(pc *pgxpool.Config) {
	pc.MaxConns = int32(o.Conns)
	pc.MinConns = 0
	rp := pc.ConnConfig.RuntimeParams
	rp["statement_timeout"] = strconv.FormatInt(max(o.QueryTimeout.Milliseconds(), 1), 10) // 0 would be none
	rp["default_transaction_read_only"] = "on"
	rp["application_name"] = AppName
}

// bound is ctx for one read of the ledger: ended after rd.timeout, if any.
func (rd *Reader) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if rd.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, rd.timeout)
}

// timedOut is err, the result of a read under ctx (bound), as ErrTimeout
// when the read ran out of time: ctx's deadline passed, or Postgres
// cancelled the statement (query_canceled: its statement_timeout, or the
// cancel request of a context that ended).
func timedOut(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	var pe *pgconn.PgError
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(ctx.Err(), context.DeadlineExceeded) ||
		errors.As(err, &pe) && pe.Code == "57014" {
		return fmt.Errorf("%w: %w", ErrTimeout, err)
	}
	return err
}
