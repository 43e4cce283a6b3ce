package wire

import (
	"errors"
	"fmt"

	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits/policy"
)

// The errors of every call; package limits exports them.
var (
	// ErrNoEpoch is limits.ErrNoEpoch: a script answered that the slot has
	// no epoch.
	ErrNoEpoch = errors.New("limits: redis has no epoch (lost its data, awaiting rebuild)")
	// ErrInvalid is limits.ErrInvalid: a builder rejected an argument.
	ErrInvalid = errors.New("limits: invalid argument")
)

// MaxID is limits.MaxID: ident.MaxLen, the one rule every boundary applies.
const MaxID = ident.MaxLen

// MaxCost is limits.MaxCost: counters are 48-bit integers in Redis, and
// the scripts saturate them here (lib.lua's MAXC).
const MaxCost = 1_000_000_000_000

// checkID applies the identifier rule (package ident) to an argument, so
// that nothing a boundary missed reaches Redis keys, events or the ledger.
func checkID(field, v string, required bool) error {
	if v == "" && required {
		return fmt.Errorf("%w: %s: required", ErrInvalid, field)
	}
	if err := ident.Check(v); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalid, field, err)
	}
	return nil
}

// checkCost checks a cost or amount: 0 to MaxCost.
func checkCost(field string, v int64) error {
	if v < 0 || v > MaxCost {
		return fmt.Errorf("%w: %s: must be between 0 and %d", ErrInvalid, field, int64(MaxCost))
	}
	return nil
}

// checkSubject checks the tenant and user of a subject call.
func checkSubject(tenant, user string) error {
	return errors.Join(checkID("tenant", tenant, true), checkID("user", user, true))
}

// checkShared rejects limits that need a subject: a shared scope keeps no
// reservation record, so it has no concurrency slots or balances.
func checkShared(rules []policy.Rule) error {
	for i := range rules {
		if k := rules[i].Kind; k == policy.Concurrency || k == policy.Balance {
			return fmt.Errorf("%w: %s: a %s limit needs a subject, not a shared scope", ErrInvalid, rules[i].Name, k)
		}
	}
	return nil
}
