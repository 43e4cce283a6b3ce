package history

import "time"

// Query is one of the console's statements with typical arguments, for
// TestPlans.
type Query struct {
	Name string
	SQL  string
	Args []any
}

// Queries are the console's statements over the ledger, with a busy
// tenant's arguments over [from, to).
func Queries(from, to time.Time) []Query {
	return []Query{
		{"history", selectHistory, []any{"t7", "", from, to, "hour"}},
		{"history/u", selectHistory, []any{"t7", "u7", from, to, "hour"}},
		{"top", selectTopUsers, []any{"t7", from, to, DefaultLimit, 0}},
		{"denials", selectDenials, []any{"t7", from, to, DefaultLimit, 0}},
		{"tenants", selectTenants, []any{"", DefaultLimit}},
		{"users", selectSubjects, []any{"t7", "", MaxLimit}},
		{"users/after", selectSubjects, []any{"t7", "u1500", MaxLimit}},
	}
}
