// Package decide is admission's decision pipeline: it resolves the policy
// for a request, checks the layers in order, reserves in Redis through
// pkg/limits, serves shared request limits from local leases, and decides
// locally when Redis is slow, down or has lost its data. Decider.Admit is
// what the HTTP layer calls for each request.
//
// # Order of checks
//
// Admit checks, in order: the IP layer (the policy's ip limits, counted per
// client address; skipped when Input.IP is empty), the global layer (the
// endpoint's global limits, shared by every caller), then the subject layer:
// the tenant-wide limits and the user's limits (plan quotas and rates, the
// endpoint's per-user limits), reserved together in ONE limits.Reserve call,
// since the keys of one tenant share a hash tag. The first denial
// short-circuits: later layers are not checked and are absent from
// Result.Limits. A denial reserves nothing anywhere: what earlier layers
// took is given back (leased units to their local pool, local spending to
// the local state, a shared reservation in Redis with a compensating
// limits.Limiter.ChargeShared). Shadow limits fill and report WouldDeny but
// never deny.
//
// Round trips: a request whose policy has only subject limits costs exactly
// one (the Reserve call). Shared request limits of the fixed and
// token_bucket kinds are served from leases and cost none on the hot path;
// any other shared limit (token units, sliding_log, rolling) costs one
// ReserveShared call per layer. A denial after a shared reservation costs a
// ChargeShared to compensate it. Reserve calls of concurrent admissions share
// their round trip: those that arrive while one pipeline is in flight go
// together in the next (limits.Limiter.ReserveBatch), each still its own
// atomic script run with its own deadline.
//
// # Leasing
//
// A leasable shared limit (limits.Leasable) of each endpoint or client IP
// has a local pool. A lease takes a batch (Options.LeaseBatch: by default
// 10% of the limit, at most 100, at least 1) that Redis counts as used at
// once; requests spend it with atomics. Below the low-water mark
// (Options.LeaseLowWater of a batch) one background call refills the pool;
// an empty pool waits for that call or makes one itself, and a grant of
// nothing denies until the window ends (a token bucket: until one unit has
// refilled). A lease is void after its expiry, the end of its window (for a
// refilling bucket, the time to refill what it granted), measured on this
// host's monotonic clock from before the call, so it never outlives its
// window and leasing never over-admits. A shadow limit is leased like any
// other; when Redis grants it nothing it reports WouldDeny and allows.
//
// Its price is under-admission: units an instance still holds when their
// window ends are lost. An instance holds at most a batch plus the low-water
// mark per pool (a refill lands on what is left), so a window loses fewer
// than instances × (batch + low water) units, and only when its traffic
// stops before the window's end: with the defaults (a batch of at most 100,
// low water half a batch) under instances × 150. Units held when an
// instance shuts down are returned by Close, and a pool unused for
// Options.LeaseIdle returns its units and is forgotten, which keeps per-IP
// pools bounded (and Options.MaxLeasePools caps them: past it, new pools are
// not made and those limits cost a round trip).
//
// # Degradation
//
// Redis failing never fails a request. Every call has Options.RedisTimeout
// (10ms), which reaches the socket only if the go-redis client is built with
// ContextTimeoutEnabled: true (build it so). A circuit breaker opens after
// Options.BreakerFailures consecutive failures, or at once when Redis
// answers without its epoch (limits.ErrNoEpoch: it lost its data), and then
// no call waits on Redis; every Options.BreakerCooldown a background probe
// (with the longer Options.ProbeTimeout, never on a request's path) checks
// Redis and its epoch, and success closes the breaker again. The prober also
// warms a connection and the script cache at start. Meanwhile, and for any
// layer whose call failed, Admit decides locally and sets Result.Local
// (counted as result="failopen"):
//
//   - request limits and shared token limits: this instance's share, a
//     local token bucket of 1/Options.Instances of the limit (after live
//     leases of a leased limit are spent);
//   - token quotas and balances of a subject or tenant: the remaining this
//     instance last saw in a Redis decision (in a table sized for
//     Options.LocalEntries owners, least recently used forgotten first),
//     spent down locally and
//     back to the full limit once the window it was seen in has passed, or
//     Options.UnseenAllowance (at most the limit) for an owner never seen;
//     what is allowed locally is owed (Redis holds none of it until its
//     actual usage is charged) and taken from every later Redis answer, so
//     the local allows owed never exceed the remaining Redis last reported
//     (a spend stays owed between owedFor and twice that; see local.go);
//   - concurrency limits: not enforced (nothing could release the slot).
//
// On a Redis Cluster a tenant's call answered without its slot's epoch
// marks only that slot lost (lostSlots): its tenants are decided locally,
// the breaker stays closed for every other tenant, and the prober peeks
// the lost slots every Options.BreakerCooldown.
//
// Redis is made to agree with each local decision afterwards (voider);
// until it does, a retry of the request id is decided locally too, even
// with the breaker closed (a call that failed before it was sent), so that
// Redis does not admit it a second time.
//
// Past Options.FailOpenAfter of continuous unreachability every request is
// allowed unchecked (still Local). A missing epoch is not an outage but a
// rebuild in progress: local limits stay in force until the accounter writes
// the epoch and a probe succeeds. A call that times out may still have run
// in Redis; every such case errs towards under-admission (a reservation or
// lease counted twice, a compensation not made while Redis is unreachable).
// Degraded reports the state for /readyz.
package decide
