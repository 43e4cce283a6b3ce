package stream

// RefitAfter is refitAfter, for the tests of package stream_test.
const RefitAfter = refitAfter

// Budget is the most bytes of events p packs into one message now.
func (p *Publisher) Budget() int64 { return p.budget.Load() }

// BudgetFor is the budget a stream's MaxMsgSize of max bytes takes.
func BudgetFor(max int64) int64 { return int64(budget(max)) }

// Backlog is backlog: whether Bursts follows a fetch of msgs at once.
var Backlog = backlog
