// Package policy is quotaflow's policy model and its loader, in plain Go
// with no Redis: what every service that reads the policy file imports.
//
// A Policy (Parse, LoadFile) holds plans with token quotas and request
// rates, tenants with a default plan and tenant-wide limits, endpoints with
// global and per-user limits, an IP layer and model cost weights.
// Policy.Resolve turns a request's tenant, plan and endpoint into Rules
// grouped by layer (IP, global, subject), which the engine (package
// limits) checks; Policy.Cost weighs a model's input and output tokens;
// Policy.Grants says which plans a caller bound to a tenant may name.
//
// # Kinds
//
// Every limit counts tokens or requests: a request costs 1 in a requests
// limit and its weighted token cost in a tokens limit. Corrections and
// releases of a reservation touch token limits and concurrency slots only;
// an admitted request stays counted in request limits. What each kind
// costs in Redis is in package limits.
//
//   - rolling: a sliding window kept as n time buckets (default 24) in a
//     ring plus a running total, so a call is O(1) amortised: buckets that
//     left the window are subtracted as time passes. Exact to one bucket:
//     the window holds the last W-W/n to W of usage. Retry-After is when
//     enough of the oldest buckets leave.
//   - fixed: a count per window aligned to the Unix epoch; exact; resets at
//     the window's end.
//   - calendar_month: a count per UTC calendar month (exact month lengths,
//     leap years); resets at 00:00 UTC on the 1st.
//   - token_bucket: refills rate/per continuously up to burst (the
//     golang.org/x/time/rate model, computed lazily from the last refill);
//     exact. With rate 0 it is an allowance of burst per period `per`,
//     starting at its first use.
//   - sliding_log: one timestamp per admitted request; exact; for small
//     request counts (at most 1000).
//   - balance: prepaid credits (credited, spent); only top-ups raise it and
//     it never expires.
//   - concurrency: requests in flight, a sorted set of request ids scored
//     by expiry: a slot is held until the reservation is settled, or until
//     its TTL passes.
package policy
