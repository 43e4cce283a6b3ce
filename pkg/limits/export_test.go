package limits

import "quotaflow/pkg/limits/internal/wire"

// CheckFast returns o with reserve and settle calls that decide every entry
// the engine's fast paths take on its general path too, in the same call,
// and fail the call on any difference in the reply or in what they store.
func CheckFast(o Options) Options {
	o.checkFast = true
	return o
}

// GeneralFor returns o with tenant's reserves and settles decided on the
// engine's general path alone: a twin of another tenant in the same calls
// shows what the fast path stores against what the general path does.
func GeneralFor(o Options, tenant string) Options {
	o.general = tenant
	return o
}

// SettleRounds is settleRounds over calls of these hash slots.
func SettleRounds(slots []uint16) [][]int {
	groups := make([]group[*wire.SettleBatch], len(slots))
	for k, s := range slots {
		groups[k].slot = s
	}
	return settleRounds(groups)
}
