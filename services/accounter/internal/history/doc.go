// Package history is the accounter's console server and its read-only usage
// API (docs/design.md §6, Usage history API): who may read what, the queries over the ledger
// and the reads of subjects' windows in Redis (through limits.Limiter, as
// admission peeks them) that the console's pages call server-side, and the
// JSON handlers over them, served on QF_CONSOLE_ADDR.
//
// # Who reads what
//
// A request is authenticated by the tokens admission accepts (package auth),
// carried in "Authorization: Bearer" or, for a browser, in the cookie
// CookieName (set by the console's sign-in: HttpOnly, SameSite=Strict).
// Authenticate turns it into a Viewer. An admin token reads every tenant; a
// token bound to a tenant reads that tenant only, whatever its roles; a
// token for every tenant that is not admin (a platform gateway's) reads
// none. Every query takes a Tenant, which only Viewer.Tenant makes, after
// that check: tenant scoping lives in that one method, and no query can be
// called for a tenant its caller may not read. A Tenant carries its
// viewer, so that a plan the windows are read on is checked as admission
// checks a request's (auth.Principal.NamesPlan).
//
// # Windows and Redis
//
// Windows and Near read subjects' limits on one plan from the Redis
// admission decides on, by the same script calls: at most MaxPeeks reads
// run at once, and one more is ErrBusy (503, Retry-After), so that a
// token asking for pages in a loop cannot take Redis from admission.
//
// # The ledger's reads
//
// The Reader reads the ledger on a pool of its own (PoolOptions), apart
// from the consumer's: at most its Conns reads run at once, the others
// wait for a connection, and each, its wait included, ends at the query
// timeout (ErrTimeout, 503), which Postgres also enforces as the
// connections' statement_timeout. However many reads a token keeps in
// flight, the ledger's writers never wait for them.
//
// # The seam with the console's pages
//
// NewHandler serves the JSON API under /v1/ and passes every other path to
// Options.Pages (the console: its pages at / and its static assets), which
// handles its own sign-in and calls Authenticate and the Reader's methods
// itself. The API answers a missing or unknown token with 401, a tenant
// the token may not read with 403 (whether or not the tenant exists, so it
// reveals nothing), bad parameters with 400; every error body is an RFC
// 9457 problem.
//
// # Recent alerts
//
// The alerts are the alerter's, read through an AlertSource: the Reader
// (the alerter's outbox in the ledger's database) or Alerter (the
// alerter's own API, package alertlog, called with the viewer's token,
// which the alerter checks again). An alerter that cannot be reached is
// 503, its refusal 502.
package history
