// Package limits is quotaflow's limits engine: it checks and reserves every
// limit of a request in Redis, all or nothing, in one round trip, and
// settles the reservation once the request's actual usage is known.
//
// A Limiter (New) takes the rules that a policy.Policy resolves for a
// request. Reserve reserves its cost in every limit of its subject or in
// none; a denial is a Decision, not an error. Correct and Release settle a
// reservation exactly once (SettleMany: up to 64 in one script call);
// ReserveShared, ChargeShared, Lease and ReturnLease serve the shared
// global, endpoint and IP layers; CountBatch decides groups of
// fixed-window counters as final charges (ShouldRateLimit's descriptors),
// many groups in one script call; TopUp credits a balance; VoidReserve
// makes Redis agree with a decision taken without it. Time comes from
// Redis, so instances with skewed clocks agree, and the keys of a call
// share one Redis Cluster hash tag.
//
// When Redis has lost its data, calls return ErrNoEpoch instead of
// deciding until the accounter has rebuilt it (package repair).
//
// # Memory in Redis
//
// The state of all limits of one scope is one Redis string; one limit's
// record in it takes: rolling 14+18+6n bytes for n buckets (176 for the
// default 24), fixed, calendar_month and balance 26, token_bucket 30,
// sliding_log 14+6k for k requests in the window. A concurrency limit is a
// sorted set, about 60 bytes per request in flight. A CountBatch counter is
// a key of its own: 12 bytes of value (window number and count) that
// expire with its window. The wire format is
// internal/wire/protocol.go.
package limits
