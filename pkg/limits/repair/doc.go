// Package repair holds the accounter's tools for what the limits engine
// keeps in Redis: rebuilding it from the ledger after Redis lost its data,
// and reading and correcting the token windows that the reconciliation
// compares with the ledger.
//
// An epoch key per cluster slot marks Redis as holding quotaflow's state.
// When Redis restarts empty, fails over to an empty replica or is flushed,
// the keys are gone and every engine call answers limits.ErrNoEpoch
// instead of deciding, so nobody gets a fresh quota; admission decides
// locally meanwhile. The accounter then finds the lost slots (LostSlots),
// clears what an unfinished rebuild left in them (ClearLost), charges the
// ledger's usage back into the windows (Tools.ChargeMany with Force),
// restores balances and reservation records (RestoreBalance, RestoreMany)
// and writes the epoch (WriteEpoch). Its reconciliation reads windows
// bucket by bucket (Tools.Windows, BucketOf, BucketStart) for every
// subject (ScanSubjects) and charges the difference.
package repair
