package pgtest

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// Whatever form QF_POSTGRES_URL takes, the tests' URLs name their own
// database: a test must never write into the one the variable names.
func TestWithDatabaseNamesTheTestsDatabase(t *testing.T) {
	for _, base := range []string{
		"postgres://postgres@127.0.0.1:5432/quotaflow?sslmode=disable",
		"postgresql://postgres@127.0.0.1/quotaflow?sslmode=disable&dbname=quotaflow",
		"host=127.0.0.1 user=postgres dbname=quotaflow sslmode=disable",
	} {
		cc, err := pgx.ParseConfig(withDatabase(base, "qf_test_x"))
		if err != nil {
			t.Errorf("withDatabase(%q): %v", base, err)
		} else if cc.Database != "qf_test_x" {
			t.Errorf("withDatabase(%q) connects to %q, want qf_test_x", base, cc.Database)
		}
	}
}
