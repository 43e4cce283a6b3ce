// Package limits is quotaflow's limits engine: the policy model and its
// loader, and the Redis scripts that check and reserve every limit of a
// request atomically, in one round trip.
//
// # Policy
//
// A Policy (Parse, LoadFile, Watcher for reloads) holds plans with token
// quotas and request rates, tenants with a default plan and tenant-wide
// limits, endpoints with global and per-user limits, an IP layer and model
// cost weights. Policy.Resolve turns a request's tenant, plan and endpoint
// into Rules grouped by layer (IP, global, subject); Policy.Cost weighs a
// model's input and output tokens; Policy.Grants says which plans a caller
// bound to a tenant may name.
//
// # Engine
//
// A Limiter runs the scripts. Reserve checks all of a subject's tenant-wide
// and user limits and reserves the cost in all of them or in none; a denial
// is a Decision, not an error. Correct and Release settle a reservation
// exactly once; TopUp credits a balance once per reference; ReserveShared,
// Lease and ReturnLease serve the shared global, endpoint and IP layers.
// Every call is one script (one round trip) and works on one Redis node and
// on a Redis Cluster: all keys of a call share one hash tag (the tenant's,
// or the endpoint's or IP's for shared limits). SettleMany and ChargeMany
// send many settlements or charges in one pipelined round trip, with the
// result of the same calls made one by one. For the accounter's
// reconciliation, Windows reads a subject's token windows bucket by bucket
// (BucketOf and BucketStart number the buckets) and ScanSubjects walks every
// subject and tenant with SCAN cursors.
//
// # Algorithms
//
// Time comes from Redis (TIME) inside the scripts, so instances with skewed
// clocks agree. The state of all limits of one scope is one Redis string (see
// lua/lib.lua for the format); bytes below are the record of one limit.
//
//   - rolling: a sliding window kept as n time buckets (default 24) in a
//     ring plus a running total, so a call is O(1) amortised: buckets that
//     left the window are subtracted as time passes. Exact to one bucket:
//     the window holds the last W-W/n to W of usage. Retry-After is when
//     enough of the oldest buckets leave. 14+18+6n bytes (176 for n=24).
//   - fixed: a count per window aligned to the Unix epoch; exact; resets at
//     the window's end. 26 bytes.
//   - calendar_month: a count per UTC calendar month (exact month lengths,
//     leap years); resets at 00:00 UTC on the 1st. 26 bytes.
//   - token_bucket: refills rate/per continuously up to burst (the
//     golang.org/x/time/rate model, computed lazily from the last refill);
//     exact. With rate 0 it is an allowance of burst per period `per`,
//     starting at its first use. 30 bytes.
//   - sliding_log: one timestamp per admitted request; exact; for small
//     request counts (at most 1000). 14+6k bytes for k requests in the window.
//   - balance: prepaid credits (credited, spent); only TopUp raises it and it
//     never expires. 26 bytes.
//   - concurrency: requests in flight, a sorted set of request ids scored by
//     expiry: a slot is held until Correct or Release, or until the
//     reservation's TTL passes. About 60 bytes per request in flight.
//
// Every limit counts tokens or requests: a request costs 1 in a requests
// limit and its weighted token cost in a tokens limit. Corrections and
// releases touch token limits and concurrency slots only; an admitted
// request stays counted in request limits.
//
// A reservation record (ReservationTTL; about 60 bytes plus 32 per limit)
// stores the time and estimate of each admitted request, a fingerprint of
// the request (endpoint, plan, model, cost) and the limits it charged. So a
// request id is an idempotency key only for the same open request: a repeat
// is a Duplicate that charges nothing, another request under the id or an
// id settled or released is a Conflict (Request). Correct moves each token
// window the reservation holds by actual-estimate in the bucket of the
// reservation's time, so a correction leaves the window together with the
// estimate, and Release gives back exactly what was reserved, whatever the
// policy says by then; actual usage wins over a release in either order.
// VoidReserve makes Redis agree with a decision taken without it after a
// Reserve whose reply was lost. A subject's version grows with each reserve
// and correction (Decision.Version), so consumers of snapshots can drop
// stale ones. Counters saturate at MaxCost, the event contract's cap.
//
// # Redis losing its data
//
// An epoch key per cluster slot (WriteEpoch, EpochMissing) marks Redis as
// holding quotaflow's state. When it is missing every script returns
// ErrNoEpoch instead of deciding: a Redis that restarted empty would
// otherwise hand everybody a fresh quota. The accounter rebuilds the windows
// from its ledger (Charge with Force), then writes the epoch.
//
// # Leases
//
// Shared request limits of the fixed and token_bucket kinds can be leased
// in batches (Lease) and spent locally; a lease never outlives its window,
// so instances never admit more than the limit together. The cost is
// under-admission by at most instances x batch per window.
package limits
